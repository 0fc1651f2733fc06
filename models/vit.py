"""The Vision Transformer (Dosovitskiy et al., ICLR 2021), named after the paper's equations.

    z0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos            (1)  embed()
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                          (2)  EncoderBlock
    z_l  = MLP(LN(z'_l)) + z'_l                                (3)  EncoderBlock
    y    = LN(z_L^0)                                           (4)  forward_head()

Choices that follow the authors' code (google-research/vision_transformer, ``models_vit.py``):

* ``head="gap"`` has no class token at all (the position embedding covers only the patch
  grid) and averages the patch tokens *after* the final LayerNorm, as the authors' and
  big_vision's gap models do.
* LayerNorm epsilon 1e-6 (Flax's default); initialisation as in Flax: LeCun-normal patch
  embedding and pre-logits, Xavier-uniform attention and MLP kernels, MLP biases N(0, 1e-6),
  class token zero, position embedding N(0, 0.02), zero head weights; the head bias is
  ``head_bias_init`` (0; the authors' sigmoid pre-training configs use -10, so that every one of
  the thousands of classes starts at probability ~4.5e-5 instead of 0.5).
* GELU is the exact (erf) form, as in PyTorch ports of the released checkpoints (timm); the
  JAX code's default tanh approximation differs by < 1e-3 per activation.

The normal path uses ``scaled_dot_product_attention`` and never materialises attention
probabilities; ``forward_with_attention`` is the (slower) inspection path. With the token head,
``forward``/``forward_pre_logits`` run the last block for the class token alone (the only token
the head reads), which is the same function with less work. The names follow timm's:
``forward_features`` gives every token (the last block run fully), ``forward_head`` pools them and
applies the head (with ``pre_logits=True``, the representation alone), ``get_classifier`` and
``reset_classifier``.

``num_classes=0`` builds no classification head (timm's convention): ``forward`` then returns
the pre-logits representation. A model built with ``masked_patch_outputs`` also has the parts of
masked patch prediction (see :mod:`vitray.models.masked_patch`), used through ``forward``'s
corruption arguments; ``reset_head`` drops them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config import ModelConfig
from .initializers import lecun_normal_, xavier_uniform_square_blocks_
from .masked_patch import MaskedPatchPrediction
from .posemb import resample_posemb
from .resnet import ResNetStem
from .variants import get_variant

BlockCheckpoint = Callable[[nn.Module, torch.Tensor, bool], torch.Tensor]

LAYERNORM_EPS = 1e-6

# The operators whose outputs `remat_policy="dots_saveable"` keeps (JAX's `dots_saveable`: every
# matrix product, here with the attention kernels, whose outputs are as costly to recompute).
_aten = torch.ops.aten
_DOTS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_dots(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _DOTS else CheckpointPolicy.PREFER_RECOMPUTE


def _dots_saveable():
    return create_selective_checkpoint_contexts(_keep_dots)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused query/key/value projection."""

    def __init__(self, width: int, num_heads: int, attn_dropout: float) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width {width} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = width // num_heads
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        xavier_uniform_square_blocks_(self.qkv.weight, num_blocks=3)
        nn.init.zeros_(self.qkv.bias)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.num_heads, self.head_dim)
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, N, head_dim)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, tokens, _ = x.shape
        return self.proj(x.transpose(1, 2).reshape(batch, tokens, self.num_heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, *, first_token_only: bool = False, return_probs: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Self-attention over ``x`` (B, N, width).

        ``first_token_only`` attends with the first token's query alone (all tokens still serve
        as keys and values) and returns ``(B, 1, width)``. ``return_probs`` also returns the
        attention probabilities ``(B, heads, queries, N)``, computed explicitly; otherwise the
        fused ``scaled_dot_product_attention`` never materialises them.
        """
        q, k, v = self._split_heads(x)
        if first_token_only:
            q = q[:, :, :1]
        if not return_probs:
            dropout_p = self.attn_dropout if self.training else 0.0
            return self._merge_heads(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p))
        probs = torch.softmax((q * self.head_dim**-0.5) @ k.transpose(-2, -1), dim=-1)
        attended = F.dropout(probs, self.attn_dropout, self.training) @ v
        return self._merge_heads(attended), probs


class MlpBlock(nn.Module):
    """Two Dense layers with a GELU between them, dropout after each (as in the authors' MlpBlock)."""

    def __init__(self, width: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)
        self.dropout = nn.Dropout(dropout)
        for layer in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.normal_(layer.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(F.gelu(self.fc1(x)))))


class EncoderBlock(nn.Module):
    """Pre-LN Transformer block, equations (2) and (3)."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, dropout: float, attn_dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=LAYERNORM_EPS)
        self.attn = SelfAttention(width, num_heads, attn_dropout)
        self.norm2 = nn.LayerNorm(width, eps=LAYERNORM_EPS)
        self.mlp = MlpBlock(width, mlp_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, *, first_token_only: bool = False, return_attention: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output tokens; ``first_token_only`` computes the first token's alone
        ``(B, 1, width)``; ``return_attention`` also returns the attention probabilities."""
        attended = self.attn(self.norm1(x), first_token_only=first_token_only, return_probs=return_attention)
        if return_attention:
            attended, probs = attended
        if first_token_only:
            x = x[:, :1]
        x = x + self.dropout(attended)
        x = x + self.mlp(self.norm2(x))
        return (x, probs) if return_attention else x


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def square_side(img_size: object) -> object:
    """A resolution given as timm takes it, one side or ``(height, width)``, as the one side of
    vitray's square inputs (anything else is returned for the usual checks to refuse)."""
    if isinstance(img_size, (tuple, list)) and len(img_size) == 2:
        height, width = img_size
        if height != width:
            raise ValueError(
                f"img_size={tuple(img_size)}: vitray's ViTs take square images; give one side, e.g. img_size={max(height, width)}"
            )
        return height
    return img_size


def _check_num_classes(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_classes must be a non-negative integer (0: no classification head), got {value!r}")


class VisionTransformer(nn.Module):
    """ViT (or hybrid ResNet+ViT) classifier; build it with :func:`vitray.models.create_model`.

    Its arguments are the fields of :class:`~vitray.models.ModelConfig`, declared there once (the
    run config's ``model`` section, :func:`create_model`'s keywords and checkpoints' ``model`` record).

    Attributes: ``name``, ``num_classes``, ``img_size``, ``patch_size`` (pixels per token side;
    for a hybrid the ResNet's stride), ``grid_size`` (tokens per side), ``width``, ``depth``,
    ``num_heads``, ``mlp_dim``, ``head_type`` ("token" | "gap"), ``representation_size``,
    ``num_features`` (size of :meth:`forward_pre_logits`), ``grad_checkpointing``,
    ``masked_patch_outputs`` (predictions per patch of the masked patch predictor, or None).
    """

    def __init__(self, config: ModelConfig, *, num_classes: int) -> None:
        """The model that ``config`` (validated: head, sizes and rates are in range) describes, with
        ``num_classes`` outputs (0: no classification head)."""
        super().__init__()
        _check_num_classes(num_classes)
        variant = get_variant(config.name)
        if config.masked_patch_outputs is not None and variant.is_hybrid:
            raise ValueError(
                f"masked patch prediction needs a plain ViT: the ResNet of {variant.name} sees every pixel, "
                "including those of the corrupted patches"
            )
        size = variant.size
        self.variant = variant
        self.name = variant.name
        self.patch_size = variant.patch_size
        self.width = size.width
        self.depth = config.blocks
        self.num_heads = size.num_heads
        self.mlp_dim = size.mlp_dim
        self.head_type = config.head
        self.num_prefix_tokens = 1 if config.head == "token" else 0
        self.grad_checkpointing = config.grad_checkpointing
        self.remat_policy = config.remat_policy
        # How a checkpointed block is recomputed: torch's checkpoint unless a backend whose
        # tensors it cannot checkpoint (XLA's lazy tensors) gives its own, (block, x,
        # first_token_only) -> block's output, keeping nothing of the block for the backward pass.
        self.block_checkpoint: BlockCheckpoint | None = None
        self._set_resolution_attributes(config.img_size)

        if variant.resnet_stages is None:
            self.stem = None
            self.patch_embed = nn.Conv2d(3, self.width, self.patch_size, stride=self.patch_size)
        else:
            self.stem = ResNetStem(variant.resnet_stages)
            if self.stem.stride != self.patch_size:
                raise ValueError(f"{self.name}: ResNet stride {self.stem.stride} != patch size {self.patch_size}")
            self.patch_embed = nn.Conv2d(self.stem.out_channels, self.width, 1)
        lecun_normal_(self.patch_embed.weight)
        nn.init.zeros_(self.patch_embed.bias)

        self.cls_token = nn.Parameter(torch.zeros(1, 1, self.width)) if config.head == "token" else None
        num_tokens = self.num_prefix_tokens + self.grid_size**2
        self.pos_embed = nn.Parameter(torch.empty(1, num_tokens, self.width).normal_(std=0.02))
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(self.width, self.mlp_dim, self.num_heads, config.dropout, config.attn_dropout)
            for _ in range(self.depth)
        )
        self.norm = nn.LayerNorm(self.width, eps=LAYERNORM_EPS)

        self.representation_size = config.representation_size
        if config.representation_size is None:
            self.pre_logits = None
        else:
            self.pre_logits = nn.Linear(self.width, config.representation_size)
            lecun_normal_(self.pre_logits.weight)
            nn.init.zeros_(self.pre_logits.bias)
        self.num_features = config.representation_size or self.width
        self.num_classes = num_classes
        self.head = (
            self._zero_linear(self.num_features, num_classes, config.head_bias_init) if num_classes else nn.Identity()
        )

        self.masked_patch: MaskedPatchPrediction | None = None
        if config.masked_patch_outputs is not None:
            self.masked_patch = MaskedPatchPrediction(self.width, config.masked_patch_outputs)

    # -- construction helpers -------------------------------------------------------------

    def _set_resolution_attributes(self, img_size: int) -> None:
        _check_positive_int("img_size", img_size)
        if img_size % self.patch_size:
            unit = "the ResNet stride" if self.variant.is_hybrid else "the patch size"
            raise ValueError(
                f"img_size {img_size} is not divisible by {unit} {self.patch_size} of {self.name}; "
                f"use a multiple of {self.patch_size}, e.g. {img_size - img_size % self.patch_size or self.patch_size}"
            )
        self.img_size = img_size
        self.grid_size = img_size // self.patch_size

    def _zero_linear(self, in_features: int, out_features: int, bias: float = 0.0) -> nn.Linear:
        reference = self.norm.weight  # new layers follow the model's current device and dtype
        layer = nn.Linear(in_features, out_features, device=reference.device, dtype=reference.dtype)
        nn.init.zeros_(layer.weight)
        nn.init.constant_(layer.bias, bias)
        return layer

    # -- forward paths -------------------------------------------------------------------

    @property
    def masked_patch_outputs(self) -> int | None:
        return None if self.masked_patch is None else self.masked_patch.outputs

    def embed(
        self, images: torch.Tensor, patch_source: torch.Tensor | None = None, patch_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Equation (1): patch (or ResNet-feature) embeddings, class token, position embedding;
        with ``patch_source``/``patch_mask``, the patch embeddings are corrupted first."""
        expected = (3, self.img_size, self.img_size)
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            # Only another resolution is fixed by set_img_size(): not a missing batch dimension,
            # channels last, or a gray or RGBA image (vitray.data.eval_transform gives RGB).
            other_size = images.ndim == 4 and images.shape[1] == 3
            raise ValueError(
                f"{self.name} expects images of shape (batch, {', '.join(map(str, expected))}), "
                f"got {tuple(images.shape)}; "
                + (
                    "call set_img_size() to change the resolution"
                    if other_size
                    else "give a batch of RGB images, channels first, in [-1, 1] (vitray.data.eval_transform "
                    "and to_model_range make them)"
                )
            )
        x = images if self.stem is None else self.stem(images)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, grid*grid, width)
        if patch_source is not None:
            x = self.masked_patch(x, patch_source, patch_mask)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.embed_dropout(x + self.pos_embed)

    def _run(self, block: EncoderBlock, x: torch.Tensor, first_token_only: bool = False) -> torch.Tensor:
        # Blocks are always invoked as modules (never via a bare method) so that module hooks
        # -- DeepSpeed ZeRO-3 parameter gathering, FSDP, user hooks -- see every call.
        if self.grad_checkpointing and torch.is_grad_enabled():
            # Non-reentrant checkpointing recomputes the block in backward instead of keeping
            # its activations (all of them, or all but the products' outputs: `remat_policy`),
            # and restores the RNG state so dropout masks match.
            if self.block_checkpoint is not None:
                return self.block_checkpoint(block, x, first_token_only)
            # Two calls, not one with a chosen context_fn: torch.compile traces context_fn only
            # when it is a selective-checkpoint one (torch's default one passed explicitly fails).
            if self.remat_policy == "dots_saveable":
                return checkpoint(
                    block, x, first_token_only=first_token_only, use_reentrant=False, context_fn=_dots_saveable
                )
            return checkpoint(block, x, first_token_only=first_token_only, use_reentrant=False)
        return block(x, first_token_only=first_token_only)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """All encoded tokens after the final LayerNorm, ``(B, [cls] + grid*grid, width)``, as timm's
        ``forward_features``; :meth:`forward_head` pools them."""
        x = self.embed(images)
        for block in self.blocks:
            x = self._run(block, x)
        return self.norm(x)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Equation (4) and the head, from :meth:`forward_features`' tokens (timm's ``forward_head``):
        the class token, or the mean token for "gap", through the pre-logits layer where the model
        has one; then the logits, or with ``pre_logits`` the representation ``(B, num_features)``."""
        pooled = tokens.mean(dim=1) if self.head_type == "gap" else tokens[:, 0]
        representation = pooled if self.pre_logits is None else torch.tanh(self.pre_logits(pooled))
        return representation if pre_logits else self.head(representation)

    def forward_pre_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The pre-logits representation ``(B, num_features)`` that linear probes use:
        ``forward_head(forward_features(images), pre_logits=True)``, with less work for the token head."""
        if self.head_type == "gap":
            return self.forward_head(self.forward_features(images), pre_logits=True)
        # Only the class token of the last block reaches the head, so that block runs its
        # attention output, projection and MLP for that token alone (all tokens still serve as
        # keys and values): the same function for about 3/4 of a block less work.
        x = self.embed(images)
        for block in self.blocks[:-1]:
            x = self._run(block, x)
        class_token = self.norm(self._run(self.blocks[-1], x, first_token_only=True))  # (B, 1, width)
        return self.forward_head(class_token, pre_logits=True)

    def forward(
        self,
        images: torch.Tensor,
        *,
        patch_source: torch.Tensor | None = None,
        patch_mask: torch.Tensor | None = None,
        predict_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, num_classes)`` (the representation when ``num_classes`` is 0).

        With all three corruption arguments, the masked patch predictions instead (see
        :meth:`predict_masked_patches`); going through ``forward`` lets training engines
        (DeepSpeed, torch-xla) run masked patch prediction like any forward pass.
        """
        corruption = (patch_source, patch_mask, predict_at)
        if any(arg is not None for arg in corruption):
            if any(arg is None for arg in corruption):
                raise ValueError("masked patch prediction needs all of patch_source, patch_mask and predict_at")
            return self.predict_masked_patches(images, patch_source, patch_mask, predict_at)
        return self.head(self.forward_pre_logits(images))

    def predict_masked_patches(
        self, images: torch.Tensor, patch_source: torch.Tensor, patch_mask: torch.Tensor, predict_at: torch.Tensor
    ) -> torch.Tensor:
        """Predictions ``(B, K, masked_patch_outputs)`` for the patches at ``predict_at`` ``(B, K)``
        of the images whose patch embeddings are corrupted as ``patch_source``/``patch_mask`` say
        (shapes and meaning: :mod:`vitray.models.masked_patch`)."""
        if self.masked_patch is None:
            raise ValueError(
                f"{self.name} was built without masked patch prediction: create it with masked_patch_outputs=..."
            )
        x = self.embed(images, patch_source, patch_mask)
        for block in self.blocks:
            x = self._run(block, x)
        patches = self.norm(x)[:, self.num_prefix_tokens :]
        chosen = patches.gather(1, predict_at.unsqueeze(-1).expand(-1, -1, self.width))
        return self.masked_patch.predictor(chosen)

    def forward_with_attention(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and, per layer, the attention probabilities ``(B, heads, N, N)`` (inspection path)."""
        x = self.embed(images)
        attentions = []
        for block in self.blocks:
            x, probs = block(x, return_attention=True)
            attentions.append(probs)
        return self.forward_head(self.norm(x)), attentions

    # -- adaptation ------------------------------------------------------------------------

    def reset_head(self, num_classes: int) -> None:
        """Prepares fine-tuning: drops the pre-training heads (pre-logits layer, masked patch
        predictor and [mask] embedding) and adds a zero-initialised head; none for 0 (the model
        then gives its features, as timm's ``reset_classifier(0)``)."""
        _check_num_classes(num_classes)
        self.masked_patch = None
        self.pre_logits = None
        self.representation_size = None
        self.num_features = self.width
        self.num_classes = num_classes
        self.head = self._zero_linear(self.width, num_classes) if num_classes else nn.Identity()

    def get_classifier(self) -> nn.Module:
        """The classification head (timm's name): a Linear, or an Identity where there is none."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's name for :meth:`reset_head`. ``global_pool`` may only name the pooling the model
        was built with ("token", or "avg" for the gap head): vitray fixes it when the model is made."""
        own = "avg" if self.head_type == "gap" else "token"
        if global_pool is not None and global_pool != own:
            raise ValueError(
                f"global_pool={global_pool!r}: {self.name} pools with {own!r} (head={self.head_type!r}), fixed when "
                f'the model is made; create it with head="gap" (avg) or head="token" to pool otherwise'
            )
        self.reset_head(num_classes)

    def start_masked_patch(self, outputs: int, num_classes: int, *, keep_predictor: bool = False) -> None:
        """Prepares masked patch pre-training from these weights: the parts of a model built for it
        with ``masked_patch_outputs=outputs`` -- a fresh ``[mask]`` embedding and predictor (with
        ``keep_predictor``, its own where it has one of that size: a continued run), no pre-logits
        layer, and the zero head of ``num_classes`` (none for 0) that the objective never trains."""
        _check_positive_int("outputs", outputs)
        held = self.masked_patch
        keep = keep_predictor and held is not None and held.outputs == outputs
        self.masked_patch = held if keep else MaskedPatchPrediction(self.width, outputs)
        self.pre_logits = None
        self.representation_size = None
        self.num_features = self.width
        self.num_classes = num_classes
        self.head = self._zero_linear(self.width, num_classes) if num_classes else nn.Identity()

    def set_img_size(self, img_size: int | tuple[int, int]) -> None:
        """Changes the input resolution (one side, or a square's ``(height, width)``) in place,
        resampling the position embedding.

        The position embedding becomes a new Parameter: build optimizers after calling this.
        """
        self._set_resolution_attributes(square_side(img_size))
        if self.pos_embed.shape[1] == self.num_prefix_tokens + self.grid_size**2:
            return
        with torch.no_grad():
            resampled = resample_posemb(self.pos_embed, self.grid_size, num_prefix_tokens=self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(resampled, requires_grad=self.pos_embed.requires_grad)

    def set_grad_checkpointing(self, enable: bool = True, remat_policy: str | None = None) -> None:
        """Turns activation checkpointing of the encoder blocks on or off; ``remat_policy`` as
        :class:`ModelConfig`'s (unchanged if not given)."""
        if remat_policy is not None:
            allowed = get_args(ModelConfig.model_fields["remat_policy"].annotation)
            if remat_policy not in allowed:
                raise ValueError(f"remat_policy={remat_policy!r} is not one of {', '.join(allowed)}")
            self.remat_policy = remat_policy
        self.grad_checkpointing = enable

    def extra_repr(self) -> str:
        return f"name={self.name!r}, img_size={self.img_size}, head={self.head_type!r}, num_classes={self.num_classes}"
