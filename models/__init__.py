"""models: real pretrained models the project makes available offline, as HF checkpoint directories (support, not a
role: `python -m models.smollm2 --out runs/smollm2`)."""
