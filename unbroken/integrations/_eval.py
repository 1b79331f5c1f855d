"""Evaluation loaders of the integrated frameworks: a tree-wide stop must not kill their
workers, and creating their iterators must not draw from the global random streams.

A framework's validation loader is a plain torch DataLoader. Its workers would die of a
scheduler's stop signal (sent to every process of the job) and torch would then raise in the
main process, losing the stop's save; :func:`unbroken.data._workers.protect` makes them leave
the stop to the main process. Creating its iterator draws the workers' base seed from the
global torch stream unless the loader has a generator of its own: with persistent workers that
draw happens once per *process*, so a resumed process draws once more than an uninterrupted run
did and every later random number (dropout) differs. A loader without a generator gets one.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data._workers import protect


def protect_eval_loader(loader: Any) -> None:
    """Protect ``loader``'s workers and give it its own generator (unbroken's loaders have
    both already; anything that is not a torch DataLoader is left alone). Accelerate's
    prepared loaders iterate the DataLoader they wrap (``base_dataloader``): that one too."""
    while isinstance(loader, torch.utils.data.DataLoader):
        protect(loader)
        if loader.generator is None:
            # Seeds only the evaluation workers' streams (nothing in the training process).
            loader.generator = torch.Generator().manual_seed(0)
        loader = getattr(loader, "base_dataloader", None)
