"""standins: what lets the whole system run on a CPU, in place of what a real run brings. Not one of the roles.

- engine.py + scheduler.py: the SGLang stand-in, a server of SGLang 0.5.23's HTTP API around any transformers
  causal LM (`python -m standins.engine --model-path DIR --port 30000`; rollout.launch=engine, the CPU default).
- tiny_model.py: the tiny pretrained model in place of a real one (model.make_tiny; `python -m standins.tiny_model`).
"""
