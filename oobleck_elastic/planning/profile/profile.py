"""The per-layer profile: the numbers the planner works from, and their JSON form.

A `ModelProfile` holds one `LayerProfile` per element of the model's flat layer list, measured
for one microbatch shape on one device kind (profiler.py) or read from a file, cached under a key
of everything the numbers depend on (cache.py). Optional fields (`device_memory_bytes`,
`tensor_parallel`, `microbatch_size`, `at_microbatch_sizes`, the I/W split, the recomputed
variant) load as None or their defaults from files without them, so older profiles read unchanged.
A profile offers the activation checkpointing modes it has numbers for (`ModelProfile.modes`);
`ModelProfile.in_mode` gives one mode's numbers in the plain fields. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ...config import JobConfig

SCHEMA_VERSION = 1

RECOMPUTE_MODES = ("none", "full")
"""Activation checkpointing modes a layer has numbers for (`training.activation_checkpoint`)."""


class ProfileError(ValueError):
    """A profile file that is missing, malformed or for another configuration."""


@dataclass(frozen=True)
class LayerProfile:
    name: str
    """Layer name (e.g. `embedding`, `block.3`, `head`)."""
    forward_s: float
    """Forward time of one microbatch, seconds (median)."""
    backward_s: float
    """Backward time of one microbatch, seconds (median)."""
    param_bytes: int
    """Bytes of the layer's parameters (tied ones counted in every layer holding them)."""
    grad_bytes: int
    """Bytes of the parameters' gradients."""
    optimizer_bytes: int
    """Bytes of optimizer state (AdamW: two moments)."""
    activation_bytes: int
    """Bytes autograd keeps for backward for one microbatch."""
    output_bytes: int = 0
    """Bytes of the layer's output for one microbatch (what crosses a stage boundary)."""
    input_grad_s: float | None = None
    """The backward split as zero-bubble schedules run it: the time of the gradient of the
    layer's input alone (I, what the stage before waits for), seconds (median). None: not
    measured (older files, analytic profiles); the planner then splits `backward_s` by a share."""
    weight_grad_s: float | None = None
    """The other half of that split: the gradient of the layer's weights (W), run after I from
    what I kept. Measured apart, I + W is about `backward_s` (a little more: two passes)."""
    recomputed_backward_s: float | None = None
    """The backward under activation recomputation (`full`): it runs the layer's forward once more.
    The profiler derives it, `backward_s + forward_s`, from its measurement without recomputation
    (analytic profiles: from FLOPs). Under the I/W split the replay belongs to I; W is unchanged.
    None: not known (older files)."""
    recomputed_activation_bytes: int | None = None
    """Bytes kept for the backward under recomputation: the layer's input and the random state, and
    what is saved outside the layer (the last layer's loss); the profiler counts them exactly."""

    def __post_init__(self) -> None:
        if (self.input_grad_s is None) != (self.weight_grad_s is None):
            raise ProfileError(f"layer {self.name}: give both input_grad_s and weight_grad_s, or neither")
        if (self.recomputed_backward_s is None) != (self.recomputed_activation_bytes is None):
            raise ProfileError(
                f"layer {self.name}: give both recomputed_backward_s and recomputed_activation_bytes, or neither"
            )

    @property
    def has_recomputed(self) -> bool:
        """Whether the numbers under recomputation are known."""
        return self.recomputed_backward_s is not None

    def recomputed(self) -> "LayerProfile":
        """This layer's numbers under recomputation in the plain fields (backward, activations, I
        with the replayed forward); ProfileError when they are not known."""
        if self.recomputed_backward_s is None or self.recomputed_activation_bytes is None:
            raise ProfileError(f"layer {self.name}: no numbers under activation recomputation")
        replay = self.recomputed_backward_s - self.backward_s
        return dataclasses.replace(
            self,
            backward_s=self.recomputed_backward_s,
            activation_bytes=self.recomputed_activation_bytes,
            input_grad_s=None if self.input_grad_s is None else self.input_grad_s + replay,
            recomputed_backward_s=None,
            recomputed_activation_bytes=None,
        )

    @property
    def split_measured(self) -> bool:
        """Whether the input and weight gradients were measured apart."""
        return self.input_grad_s is not None

    def split_backward(self, weight_share: float) -> tuple[float, float]:
        """(input gradient, weight gradient) seconds: the measured ones, else `backward_s` split
        with W = weight_share x backward_s."""
        if self.input_grad_s is not None and self.weight_grad_s is not None:
            return self.input_grad_s, self.weight_grad_s
        return self.backward_s * (1.0 - weight_share), self.backward_s * weight_share

    @property
    def static_bytes(self) -> int:
        """Bytes that stay on the device whatever the schedule: params, grads, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def time_s(self) -> float:
        """Forward plus backward time."""
        return self.forward_s + self.backward_s


@dataclass
class ModelProfile:
    layers: list[LayerProfile]
    """One entry per layer of the flat layer list, in order."""
    key: dict[str, Any] = field(default_factory=dict)
    """What the numbers depend on: model config, microbatch shape, dtype, device."""
    device_memory_bytes: int | None = None
    """Total memory of the measured device in bytes; None when unknown (CPU, hand-made files)."""
    tensor_parallel: int = 1
    """Devices each layer was sharded over when measured: times include the layer's collectives,
    bytes are per device."""
    microbatch_size: int | None = None
    """The microbatch size `layers` were measured at; None: the key's `microbatch_size` when it is
    a number, else unknown."""
    at_microbatch_sizes: dict[int, list[LayerProfile]] = field(default_factory=dict)
    """The same layers measured at other microbatch sizes (profiles for microbatch_size auto)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError("a profile needs at least one layer")
        if self.microbatch_size is not None and (isinstance(self.microbatch_size, bool) or self.microbatch_size < 1):
            raise ProfileError(f"microbatch_size must be >= 1 (got {self.microbatch_size})")
        if self.at_microbatch_sizes and self.measured_microbatch_size is None:
            raise ProfileError("at_microbatch_sizes needs microbatch_size: the size the main layers were measured at")
        for size, layers in self.at_microbatch_sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ProfileError(f"at_microbatch_sizes: size {size!r} is not a positive integer")
            if [la.name for la in layers] != [la.name for la in self.layers]:
                raise ProfileError(f"at_microbatch_sizes[{size}] does not have the profile's layers")
        if self.tensor_parallel < 1:
            raise ProfileError(f"tensor_parallel must be >= 1 (got {self.tensor_parallel})")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ProfileError(f"device_memory_bytes must be > 0 (got {self.device_memory_bytes})")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def measured_microbatch_size(self) -> int | None:
        """The size `layers` were measured at: `microbatch_size`, else the key's when it is a number."""
        if self.microbatch_size is not None:
            return self.microbatch_size
        size = self.key.get("microbatch_size") if isinstance(self.key, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None

    @property
    def base_mode(self) -> str:
        """The activation checkpointing mode of the plain fields: `full` when the key says the
        layers were measured or modelled recomputed (older files), else `none`."""
        key = self.key if isinstance(self.key, dict) else {}
        if "activation_checkpoint" in key:
            return str(key["activation_checkpoint"])
        return "full" if key.get("recompute") else "none"

    @property
    def _has_recomputed(self) -> bool:
        every = [self.layers, *self.at_microbatch_sizes.values()]
        return all(la.has_recomputed for layers in every for la in layers)

    @property
    def modes(self) -> tuple[str, ...]:
        """The activation checkpointing modes this profile has numbers for: its base mode, and
        `full` as well when every layer (at every microbatch size) has its recomputed variant."""
        if self.base_mode != "none":
            return (self.base_mode,)
        return RECOMPUTE_MODES if self._has_recomputed else ("none",)

    @property
    def mode_unstated(self) -> bool:
        """Whether the profile neither states a mode nor has recomputed numbers (a hand-made file):
        `none` and `full` plan with its numbers as they are, `auto` cannot."""
        key = self.key if isinstance(self.key, dict) else {}
        return not ({"activation_checkpoint", "recompute"} & set(key)) and not self._has_recomputed

    def in_mode(self, mode: str) -> "ModelProfile":
        """This profile with `mode`'s numbers in the plain fields: `none` and `auto` (which needs
        both modes) give itself, the recomputed variants kept beside (as does a profile whose mode
        is unstated, for none and full); ProfileError when it has no numbers for `mode`."""
        if self.mode_unstated and mode != "auto":
            return self
        if not all(m in self.modes for m in (RECOMPUTE_MODES if mode == "auto" else (mode,))):
            raise ProfileError(f"the profile has numbers for activation_checkpoint {'/'.join(self.modes)}, not {mode}")
        if mode in (self.base_mode, "auto"):
            return self
        return dataclasses.replace(
            self,
            layers=[la.recomputed() for la in self.layers],
            at_microbatch_sizes={b: [la.recomputed() for la in ls] for b, ls in self.at_microbatch_sizes.items()},
            key={**self.key, "activation_checkpoint": mode},
        )

    def measurements(self) -> dict[int, list[LayerProfile]]:
        """Layers by the microbatch size they were measured at (empty when that size is unknown)."""
        base = self.measured_microbatch_size
        if base is None:
            return {}
        return {**self.at_microbatch_sizes, base: self.layers}

    def to_json(self) -> dict[str, Any]:
        out = {"schema_version": SCHEMA_VERSION, "key": self.key, "layers": [_layer_json(la) for la in self.layers]}
        if self.device_memory_bytes is not None:
            out["device_memory_bytes"] = self.device_memory_bytes
        if self.tensor_parallel != 1:
            out["tensor_parallel"] = self.tensor_parallel
        if self.microbatch_size is not None:
            out["microbatch_size"] = self.microbatch_size
        if self.at_microbatch_sizes:
            out["at_microbatch_sizes"] = {
                str(b): [_layer_json(la) for la in layers] for b, layers in sorted(self.at_microbatch_sizes.items())
            }
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<profile>") -> "ModelProfile":
        if not isinstance(data, dict) or "layers" not in data:
            raise ProfileError(f"{source}: not a profile (expected an object with 'layers')")
        if data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ProfileError(
                f"{source}: schema_version {data.get('schema_version')} is not {SCHEMA_VERSION}; re-create the profile"
            )
        if not isinstance(data["layers"], list):
            raise ProfileError(f"{source}: 'layers' must be a list")
        layers = []
        for i, item in enumerate(data["layers"]):
            try:
                layers.append(_layer_from_json(item))
            except (TypeError, ValueError, KeyError) as err:
                raise ProfileError(f"{source}: layer {i}: {err}") from None
        if not isinstance(data.get("key") or {}, dict):
            raise ProfileError(f"{source}: 'key' must be an object")
        memory = data.get("device_memory_bytes")
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
            raise ProfileError(f"{source}: device_memory_bytes must be a positive integer (got {memory!r})")
        tp = data.get("tensor_parallel", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ProfileError(f"{source}: tensor_parallel must be a positive integer (got {tp!r})")
        size = data.get("microbatch_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ProfileError(f"{source}: microbatch_size must be a positive integer (got {size!r})")
        more = data.get("at_microbatch_sizes") or {}
        if not isinstance(more, dict):
            raise ProfileError(f"{source}: 'at_microbatch_sizes' must be an object (size -> layers)")
        at_sizes: dict[int, list[LayerProfile]] = {}
        for b, items in more.items():
            if not str(b).isdigit() or int(b) < 1 or not isinstance(items, list):
                raise ProfileError(
                    f"{source}: at_microbatch_sizes: {b!r} must be a positive size with a list of layers"
                )
            try:
                at_sizes[int(b)] = [_layer_from_json(item) for item in items]
            except (TypeError, ValueError, KeyError) as err:
                raise ProfileError(f"{source}: at_microbatch_sizes[{b}]: {err}") from None
        try:
            return cls(
                layers=layers,
                key=dict(data.get("key") or {}),
                device_memory_bytes=memory,
                tensor_parallel=tp,
                microbatch_size=size,
                at_microbatch_sizes=at_sizes,
            )
        except ProfileError as err:
            raise ProfileError(f"{source}: {err}") from None

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"profile file '{path}' does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ProfileError(f"{path}: not valid JSON ({err})") from None
        return cls.from_json(data, source=str(path))


_INT_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes")
_SPLIT_FIELDS = ("input_grad_s", "weight_grad_s")
_OPTIONAL_FIELDS = (*_SPLIT_FIELDS, "recomputed_backward_s", "recomputed_activation_bytes")


def _layer_json(layer: LayerProfile) -> dict[str, Any]:
    """A layer's JSON object; the optional fields only when known."""
    return {k: v for k, v in asdict(layer).items() if not (k in _OPTIONAL_FIELDS and v is None)}


def _layer_from_json(item: Any) -> LayerProfile:
    if not isinstance(item, dict):
        raise TypeError("expected an object")
    unknown = set(item) - {"name", "forward_s", "backward_s", *_INT_FIELDS, *_OPTIONAL_FIELDS}
    if unknown:
        raise KeyError(f"unknown fields {sorted(unknown)}")
    kw: dict[str, Any] = {"name": str(item["name"])}
    times = ("forward_s", "backward_s", *_SPLIT_FIELDS, "recomputed_backward_s")
    for k in (t for t in times if item.get(t) is not None):
        v = float(item[k])
        if not v >= 0:
            raise ValueError(f"{k} must be >= 0 (got {item[k]})")
        kw[k] = v
    for k in (*_INT_FIELDS, "recomputed_activation_bytes"):
        if item.get(k) is not None:
            v = int(item[k])
            if v < 0:
                raise ValueError(f"{k} must be >= 0 (got {item[k]})")
            kw[k] = v
        elif k in _INT_FIELDS and k != "output_bytes":
            raise KeyError(f"missing field '{k}'")
    return LayerProfile(**kw)


def profile_cache_key(key: dict[str, Any]) -> str:
    """A short stable digest of a profile key (used as the cache file name)."""
    blob = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def recompute_mismatch(cfg: JobConfig, profile: ModelProfile, path: str) -> Optional[str]:
    """Why `profile` (from `path`) cannot plan this job: it has no numbers for
    `training.activation_checkpoint` (`auto` needs both `none` and `full`), so its backward times
    and activation bytes would not be the engine's; None when it has them, or when it states no
    mode and has no recomputed numbers (a hand-made file) and the job's mode is not `auto`."""
    asked = cfg.training.activation_checkpoint
    have = profile.modes
    if all(mode in have for mode in (RECOMPUTE_MODES if asked == "auto" else (asked,))):
        return None
    if profile.mode_unstated and asked != "auto":  # says nothing: its numbers as they are
        return None
    one = have[0] if len(have) == 1 else "none"
    return (
        f"{path} has numbers for training.activation_checkpoint={'/'.join(have)} only (its backward times and "
        f"activation bytes assume it) but this job has training.activation_checkpoint={asked}: set it to {one}, "
        "or use a profile made with both modes (profiles made now have both)"
    )
