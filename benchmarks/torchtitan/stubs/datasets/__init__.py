"""A stand-in for Hugging Face `datasets`, which TorchTitan 0.2.2 imports at
module level (torchtitan/hf_datasets/text_datasets.py) but which the GPU
machine lacks and our peer never uses: its batches are the trainer's
synthetic ones (synthetic_tokens.py). Anything that reaches for a real
dataset fails loudly."""


class Dataset:  # noqa: D101 - only a name to import
    pass


class IterableDataset:  # noqa: D101
    pass


def load_dataset(*args, **kwargs):
    raise RuntimeError("benchmarks/torchtitan/stubs/datasets: the TorchTitan peer trains on "
                       "synthetic tokens; no Hugging Face dataset is available "
                       f"(load_dataset{args!r})")
