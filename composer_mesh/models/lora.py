"""LoRA on a transformers causal LM (via peft), kept as the plain model.

`apply_lora` injects adapters into the model in place and returns the model itself — still the transformers
`*ForCausalLM`, whose targeted layers became peft LoRA layers (`<module>.base_layer` + `<module>.lora_A/B.default`)
— so every forward path (the chunked LM head included) runs it unchanged. No `PeftModel` wrapper is kept.

What a trainer and a generator need on top:

- `merged_weights(model)`: the full weights with the adapters merged in (base + delta), under the PLAIN model's
  names and shapes: exactly the keys of `loading.named_weights` of the model before `apply_lora`. Computed
  without changing the model. What every generator can load.
- `adapter_weights(model)` / `load_adapter_weights(model, named)`: the adapter tensors alone, by the injected
  model's parameter names (`<module>.lora_A.default.weight`, ...). A generator that called `apply_lora` with
  the same `LoraConfig` has the same names and shapes, so it can take a trainer's adapters in place.
- `adapter_disabled(model)`: the base model (adapters off) for a block: the reference policy of KL / DPO.
- `save_adapter(model, directory)`: the adapter in peft's own format (`adapter_config.json` +
  `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` and vLLM's LoRA loading read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from composer_mesh.models.loading import named_weights

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from composer_mesh.models.config import LoraConfig

ADAPTER = "default"  # peft's adapter name: the only adapter a model gets here
_BASE = ".base_layer"


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:  # an optional dependency
        raise ImportError("LoRA (trainer.settings.lora) needs peft: pip install 'composer-mesh[lora]'") from e
    return peft


def peft_config(cfg: LoraConfig) -> Any:
    """The `peft.LoraConfig` of `cfg` (plain LoRA: no bias, no DoRA)."""
    return _peft().LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules, bias="none",
    )


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Refuse target names that match no module, or that match the LM head or the input embeddings (peft's
    matching: a module's full name, or its name ending in `.<target>`). Also run before launch on a meta-device
    skeleton of the model (`app.preflight.models`)."""
    if cfg.target_modules == "all-linear":  # peft leaves the output head out by itself
        return
    names = [n for n, _ in model.named_modules() if n]
    frozen = {
        id(m): what for m, what in ((model.get_output_embeddings(), "LM head"),
                                    (model.get_input_embeddings(), "input embeddings")) if m is not None
    }
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    for target in cfg.target_modules:
        matches = [n for n in names if n == target or n.endswith(f".{target}")]
        if not matches:
            raise ValueError(f"lora.target_modules: {target!r} names no module of {type(model).__name__} "
                             f"(its linear layers: {', '.join(linear)})")
        for n in matches:
            what = frozen.get(id(model.get_submodule(n)))
            if what is not None:
                raise ValueError(f"lora.target_modules: {target!r} matches {n!r}, the model's {what}: LoRA goes on "
                                 "the layers inside the model (the head and embeddings stay frozen and plain)")


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int = 0) -> PreTrainedModel:
    """Inject `cfg`'s adapters into `model` in place and return it: base parameters frozen
    (`requires_grad=False`), adapter parameters trainable. Adapters start as an identity (lora_B is zero, lora_A
    drawn from `seed`: the same in every process, whatever the RNGs went through, which are left as they were),
    and are float32 even on a bf16/fp16 model (peft's default)."""
    peft = _peft()
    if lora_layers(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    check_targets(model, cfg)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(cfg)).get_base_model()


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> peft LoRA layer, in module order ({} for a model without adapters)."""
    if not hasattr(model, "peft_config"):  # set by peft on every model it injected into: no import otherwise
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _require_lora(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters (call apply_lora first)")
    return layers


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter parameters, by the injected model's names, in model order. Detached views that share
    storage with the model (as `named_weights`): copy them to keep a version."""
    layers = _require_lora(model)
    names = {f"{prefix}.{n}" for prefix, layer in layers.items()
             for n, _ in layer.named_parameters() if not n.startswith(f"{_BASE[1:]}.")}
    return {n: p.detach() for n, p in model.named_parameters() if n in names}


def adapter_specs(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of `adapter_weights(model)`."""
    return {n: (tuple(t.shape), t.dtype) for n, t in adapter_weights(model).items()}


def load_adapter_weights(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
    """Copy `named` (another model's `adapter_weights`, e.g. a trainer's) into `model`'s adapters in place
    (cast to their dtype). The names and shapes must be exactly `adapter_weights(model)`'s: anything else raises
    ValueError naming it, before anything is copied."""
    live = adapter_weights(model)
    problems = [f"missing {n}" for n in live if n not in named]
    problems += [f"unexpected {n}" for n in named if n not in live]
    problems += [f"{n}: got {tuple(t.shape)}, the model's is {tuple(live[n].shape)}"
                 for n, t in named.items() if n in live and t.shape != live[n].shape]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(f"adapter weights do not fit this model's LoRA adapters (same LoraConfig and model?): {shown}")
    with torch.no_grad():
        for n, t in named.items():
            live[n].copy_(t)


def merged_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights of the model with its adapters merged, under the plain model's names: `named_weights` of the
    model before `apply_lora` (same keys, order and shapes), each LoRA layer's weight being base + delta as
    peft's merge computes it. The model is not changed; untouched tensors are shared (as in `named_weights`)
    unless cast. `dtype`: floating tensors cast to it, one at a time (no second full-precision copy)."""
    tensors = named_weights(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, (source, layer) in merge_sources(model).items():
            t = tensors[source] if layer is None else _merge(layer, tensors[source])
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def merge_sources(model: torch.nn.Module) -> dict[str, tuple[str, Any]]:
    """The merged model's tensors (`merged_weights`' keys, in order): plain name -> (the name of the injected
    model's tensor it starts from, and the LoRA layer whose delta is added to it, or None)."""
    layers = _require_lora(model)
    adapters = adapter_weights(model)
    out: dict[str, tuple[str, Any]] = {}
    for name in named_weights(model):
        if name in adapters:
            continue
        owner, _, attr = name.rpartition(".")
        layer = layers.get(owner[: -len(_BASE)]) if owner.endswith(_BASE) else None
        if layer is None:
            out[name] = (name, None)
            continue
        merges = attr == "weight" and not layer.merged and not layer.disable_adapters
        out[f"{owner[: -len(_BASE)]}.{attr}"] = (name, layer if merges else None)
    return out


def adapter_pair(source: str) -> tuple[str, str]:
    """The names of the lora_A and lora_B weights of the layer whose base weight is `source` (a
    `merge_sources` source with a layer)."""
    prefix = source.removesuffix(f"{_BASE}.weight")
    return f"{prefix}.lora_A.{ADAPTER}.weight", f"{prefix}.lora_B.{ADAPTER}.weight"


def delta_from(layer: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`layer.get_delta_weight(ADAPTER)` from whole A and B given here (a sharded model's, gathered): the same
    arithmetic as peft's, which reads them from the layer."""
    from peft.utils.other import transpose

    cast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)  # as peft: CPU half matmuls are slow
    delta = transpose((b.float() @ a.float()) if cast else b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER]
    return delta.to(b.dtype) if cast else delta


def _merge(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """weight + the layer's active adapters' deltas (peft's safe merge, without writing it back)."""
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model` as its base model (every adapter off) inside the block; restores each layer's state and the
    adapters' `requires_grad` flags (which peft's toggling changes) on the way out."""
    layers = list(_require_lora(model).values())
    flags = [(p, p.requires_grad) for layer in layers
             for n, p in layer.named_parameters() if not n.startswith(f"{_BASE[1:]}.")]
    disabled = [layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, was in zip(layers, disabled):
            layer.enable_adapters(not was)
        for p, requires_grad in flags:
            p.requires_grad_(requires_grad)


def save_adapter(model: torch.nn.Module, directory: str | Path, adapters: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter in peft's format under `directory` (`adapter_config.json`, `adapter_model.safetensors`):
    what `peft.PeftModel.from_pretrained(<base model>, directory)` loads. `adapters`: the adapter tensors by
    `adapter_weights`' names, when the model's own are not whole (a sharded model's, gathered)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    _require_lora(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if adapters is None:
        state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    else:  # peft's state-dict names drop the adapter's name
        state = {name.replace(f".{ADAPTER}.", "."): t for name, t in adapters.items()}
    # A PeftModel's state-dict names (what from_pretrained expects): its `base_model.model.` prefix.
    tensors = {f"base_model.model.{k}": v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[ADAPTER].save_pretrained(str(directory))
    return directory
