"""The model side of masked patch prediction (paper section 4.6, appendix B.1.2).

Masked patch prediction corrupts some patch embeddings ``x_p E`` before the position embedding
is added -- replacing them by a learnable ``[mask]`` embedding or by another patch's embedding,
or keeping them -- and predicts something about each corrupted patch from its output token. The
parts this needs exist only in a model built for it (``masked_patch_outputs=...``) and are
dropped by :meth:`VisionTransformer.reset_head`, so transfer sees a plain ViT.

Which patches are corrupted, and how, is decided by the caller (the training objective) and
passed in as three tensors of fixed shape, so a compiled graph (XLA) never changes:

- ``patch_source`` ``(B, N)`` int64: the patch (``0 .. N-1``, of the same image) whose embedding
  each position takes (``arange(N)`` in every row leaves all as they are). Staying within the
  image keeps every sample's input independent of the others in its batch, and a batch-sharded
  computation (SPMD) free of communication;
- ``patch_mask`` ``(B, N)`` bool: positions whose embedding becomes the ``[mask]`` embedding
  (applied after ``patch_source``);
- ``predict_at`` ``(B, K)`` int64: the patch positions (``0 .. N-1``, raster order) whose output
  tokens are fed to the predictor.
"""

from __future__ import annotations

import torch
from torch import nn


class MaskedPatchPrediction(nn.Module):
    """The learnable ``[mask]`` embedding and the per-patch predictor (a Linear layer).

    Calling the module corrupts patch embeddings; ``predictor`` maps output tokens to the
    prediction targets. Both are module calls, so engines that hook modules (DeepSpeed ZeRO-3)
    gather these parameters like any other.
    """

    def __init__(self, width: int, outputs: int) -> None:
        super().__init__()
        # BERT's initialisation for token embeddings; the predictor starts at zero like the
        # classification head, so the first steps predict the uniform distribution (or zeros).
        self.mask_token = nn.Parameter(torch.empty(1, 1, width).normal_(std=0.02))
        self.predictor = nn.Linear(width, outputs)
        nn.init.zeros_(self.predictor.weight)
        nn.init.zeros_(self.predictor.bias)

    @property
    def outputs(self) -> int:
        return self.predictor.out_features

    def forward(self, embeddings: torch.Tensor, patch_source: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """Patch embeddings ``(B, N, width)`` with the corruption applied."""
        batch, tokens, width = embeddings.shape
        if patch_source.shape != (batch, tokens) or patch_mask.shape != (batch, tokens):
            raise ValueError(
                f"patch_source and patch_mask must have shape (batch, patches) = {(batch, tokens)}, "
                f"got {tuple(patch_source.shape)} and {tuple(patch_mask.shape)}"
            )
        moved = embeddings.gather(1, patch_source.unsqueeze(-1).expand(-1, -1, width))
        return torch.where(patch_mask.unsqueeze(-1), self.mask_token.to(embeddings.dtype), moved)
