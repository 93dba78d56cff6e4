"""Collection order for the two pytest workers (pytest.ini: -n 2 --dist loadfile, a file per worker): the longest
files first (their share of a one-worker run: test_train ~175 s, test_learning ~85 s, test_moe ~70 s, test_rollout
~50 s, test_strategies ~40 s of ~685 s), so that no worker takes one of them last and runs it alone while the other
idles. The rest keep their order."""

LONGEST_FIRST = ("test_train.py", "test_learning.py", "test_moe.py", "test_rollout.py", "test_strategies.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # a stable sort
