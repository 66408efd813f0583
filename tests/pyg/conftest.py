# PyG's test files under upstream/ run only through tests/test_pyg_suite.py, with edgedot's layers
# swapped in (swap_plugin.py); collected directly they would test PyG's own layers.
collect_ignore = ["upstream"]
