"""See __init__.py: only the name TorchTitan imports."""


def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("benchmarks/torchtitan/stubs/datasets: no Hugging Face dataset here")
