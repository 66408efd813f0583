"""pytest plugin: PyG's own test files run against edgedot's layers.

``python -m pytest -p swap_plugin <PyG test files>`` (with ``tests/pyg`` on ``sys.path``) makes
every name by which those tests (and PyG's own code) reach a swapped PyG class
(``TransformerConv``, ``GATConv``, ``GATv2Conv``, ``AGNNConv``, ``InnerProductDecoder``) edgedot's
class, before any test module is imported; the test bodies stay unchanged.
"""

import importlib

import edgedot.nn

# PyG class name -> (edgedot's drop-in, the modules of PyG that hold the name: where it is
# defined, so that PyG's own code (GAE's default decoder) builds edgedot's, and where it is exposed).
SWAPPED = {
    "TransformerConv": (edgedot.nn.TransformerConv, ("torch_geometric.nn.conv.transformer_conv",
                                                     "torch_geometric.nn.conv", "torch_geometric.nn")),
    "GATConv": (edgedot.nn.GATConv, ("torch_geometric.nn.conv.gat_conv", "torch_geometric.nn.conv",
                                     "torch_geometric.nn")),
    "GATv2Conv": (edgedot.nn.GATv2Conv, ("torch_geometric.nn.conv.gatv2_conv", "torch_geometric.nn.conv",
                                         "torch_geometric.nn")),
    "AGNNConv": (edgedot.nn.AGNNConv, ("torch_geometric.nn.conv.agnn_conv", "torch_geometric.nn.conv",
                                       "torch_geometric.nn")),
    "InnerProductDecoder": (edgedot.nn.InnerProductDecoder, ("torch_geometric.nn.models.autoencoder",
                                                             "torch_geometric.nn.models", "torch_geometric.nn")),
}


def pytest_configure(config):
    """Puts edgedot's classes in PyG's namespaces (the session is a separate process)."""
    for name, (cls, module_names) in SWAPPED.items():
        for module_name in module_names:
            module = importlib.import_module(module_name)
            assert hasattr(module, name), f"{module_name} has no {name} to swap"
            setattr(module, name, cls)


def pytest_report_header(config):
    return f"edgedot swapped in for torch_geometric.nn.{{{', '.join(sorted(SWAPPED))}}}"


def pytest_collection_modifyitems(session, config, items):
    """Fails the session if a collected test module holds PyG's class instead of edgedot's (a
    swap that did not take would pass PyG's tests with PyG's own layer)."""
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        for name, (cls, _) in SWAPPED.items():
            found = getattr(module, name, cls)
            if found is not cls:
                raise RuntimeError(f"{module.__name__}.{name} is {found!r}, not edgedot's class")
