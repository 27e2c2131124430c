"""A torch checkpoint (state_dict) to a fedsplit weight file (``fedsplit export``): what a
hospital training outside Flower runs before `fedsplit upload`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsplit.protocol import Update, write_weights
from fedsplit.protocol.errors import WeightFileError

_NESTED_KEYS = ("state_dict", "model_state_dict", "model")


def load_state_dict(path: Path) -> tuple[dict[str, Any], list[str]]:
    """Load a checkpoint's float tensors; return them and the names of skipped non-float entries."""
    import torch

    if not path.is_file():
        raise WeightFileError(f"Checkpoint {path} does not exist. Received: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightFileError(
            f"Checkpoint {path} is not a torch file loadable with weights_only=True ({e}). Save "
            f"it with torch.save(model.state_dict(), path). Received: {path.name}"
        ) from e
    if isinstance(obj, dict):
        for key in _NESTED_KEYS:
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj:
        raise WeightFileError(
            f"Checkpoint {path} holds no state_dict (a dict of tensors). Save it with "
            f"torch.save(model.state_dict(), path). Received: {type(obj).__name__}"
        )
    tensors, skipped = {}, []
    for name, value in obj.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            tensors[str(name)] = value.float() if value.dtype == torch.bfloat16 else value
        else:
            skipped.append(str(name))
    return tensors, skipped


def export_checkpoint(checkpoint: Path, output: Path, *, num_examples: int,
                      site: str | None = None, compress: bool = False) -> tuple[Update, list[str]]:
    """Write ``checkpoint``'s float parameters to ``output``; return the update written and the
    names of the non-float entries left out."""
    tensors, skipped = load_state_dict(checkpoint)
    update = Update.from_state_dict(tensors, num_examples=num_examples, site=site)
    write_weights(update, output, compress=compress)
    return update, skipped
