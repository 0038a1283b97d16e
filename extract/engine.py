"""The extraction engine: one loaded, sharded model and a compiled forward per bucket length.

The data pipeline hands it right-padded token batches and gets back the requested outputs (hidden states and hook
points) as device arrays, dispatched asynchronously, their copies to the host already started; it decides when to
block (when it takes a batch's host copy for writing).

Decided once, at construction, and logged: the mesh, the attention kernel (`extract.attention.choose_kernel`) and
whether a step fits the device's memory (`extract.memory`; a step that does not is a `DeviceMemoryError` naming
`batch_size` and `max_seq_len`, before any weight is read). Each compiled program is checked again against the
memory with XLA's own figure, and an out-of-memory at run time becomes the same error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from activations.format import EXACT_EXPERT_INDICES, HookPoint, Output, output_key
from extract import attention, costmodel
from extract import memory as mem
from extract import sharding as shd
from extract import weightcache
from extract.config import ModelConfig
from extract.errors import BadInput
from extract.model import DecoderModel
from extract.weights import Checkpoint, download_hub_config, is_hub_id, load_state, resolve_model_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
#: Overrides the memory one device may use, in bytes (a device shared with another program; tests).
DEVICE_MEMORY_ENV = "EXTRACT_DEVICE_MEMORY"

# Dense bf16 peak FLOP/s per device, from the vendors' spec sheets (without structured sparsity). Matched against
# `device.device_kind` in order, so more specific names come first.
_PEAK_BF16_FLOPS = (
    (r"TPU v6", 918e12),  # v6e (Trillium), reported as "TPU v6 lite"
    (r"TPU v5 lite|TPU v5e|TPU v5litepod", 197e12),
    (r"TPU v5p|TPU v5\b", 459e12),
    (r"TPU v4", 275e12),
    (r"TPU v3", 123e12),
    (r"TPU v2", 45e12),
    (r"B200", 2250e12),
    (r"H200", 989e12),
    (r"H100.*PCIe", 756e12),
    (r"H100", 989e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bT4\b", 65e12),  # fp16: the T4 has no bf16 units (https://www.nvidia.com/en-us/data-center/tesla-t4/)
)


def device_peak_flops(device: jax.Device) -> float | None:
    if device.platform == "cpu":
        return None
    for pattern, flops in _PEAK_BF16_FLOPS:
        if re.search(pattern, device.device_kind):
            return flops
    return None


def normalize_layers(layers: Sequence[int], num_hidden_layers: int, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Sorted, de-duplicated, non-negative hidden-state indices in 0..num_hidden_layers (negatives count back)."""
    count = num_hidden_layers + 1
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise BadInput(f"layers={layers!r} must be a list of hidden-state indices such as [0, 12, -1]")
    normalized = set()
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise BadInput(f"layers: {index!r} is not an integer hidden-state index")
        if not -count <= index < count:
            raise BadInput(
                f"layers: index {index} is out of range for a model with num_hidden_layers={num_hidden_layers}: "
                f"use 0..{num_hidden_layers} (0 = embeddings, {num_hidden_layers} = final norm) or -{count}..-1"
            )
        normalized.add(int(index) % count)
    if not normalized and not allow_empty:
        raise BadInput("layers is empty: request at least one hidden-state index")
    return tuple(sorted(normalized))


class Outputs(dict):
    """{output: [batch_size, T, width]} as `Engine.forward` returns it (outputs are hidden-state indices and hook
    points), and `nonfinite`: int32 [batch_size, T, outputs], per token and output (in `Engine.outputs` order), how
    many of its values are inf or NaN once cast to the output dtype. The writer skips (or fails on) such samples."""

    nonfinite: jax.Array | None = None


def _dtype(field: str, name: str):
    if name not in DTYPES:
        raise BadInput(f"{field}={name!r} is not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _positive_int(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise BadInput(f"{field}={value!r} must be a positive integer")
    return int(value)


class Engine:
    """A model loaded onto a ("data", "model") mesh, computing its outputs up to the deepest layer they need.

    `layers` uses transformers' `output_hidden_states` numbering: 0 = embedding output, i = output of layer i,
    `num_hidden_layers` = final-norm output; negative indices count from the end (-1 = final norm). `sites` names
    hook points inside layers, {site: [layers counted from 0]} (activations.format.SITES). `outputs` holds both:
    the hidden-state indices (ints), then the hook points.
    """

    model_dir: pathlib.Path
    config: ModelConfig
    layers: tuple[int, ...]
    outputs: tuple[Output, ...]
    mesh: jax.sharding.Mesh
    batch_size: int
    compiled_programs: int

    @staticmethod
    def compile_hook(seq_len: int, packed: bool, stage: str) -> contextlib.AbstractContextManager:
        """Wraps each program's two stages: `trace` (tracing and lowering) and `compile` (XLA's compile). The
        consumer replaces it on its engine to count their time (extract/phases.py) and to seal what the compile
        writes to the compilation cache (extract/compilecache.py)."""
        return contextlib.nullcontext()

    def __init__(
        self,
        model: str,
        layers: Sequence[int],
        *,
        batch_size: int,
        max_seq_len: int,
        compute_dtype: str = "bfloat16",
        out_dtype: str = "bfloat16",
        mesh: str | None = None,
        devices: Sequence[jax.Device] | None = None,
        attention: str = "auto",
        device_memory: int | None = None,
        sites: dict[str, Sequence[int]] | None = None,
    ):
        """`devices` defaults to every device of the program (every host's, on a slice); tests pass a subset to
        get a single-device reference. `attention` is `auto` (the decision in `extract.attention.choose_kernel`)
        or a kernel name. `device_memory` (bytes per device) overrides what the runtime reports (or
        $EXTRACT_DEVICE_MEMORY)."""
        started = time.monotonic()
        self._configure(batch_size, max_seq_len, compute_dtype, out_dtype, attention, device_memory)
        from_store = isinstance(model, str) and model.startswith("gs://")
        if is_hub_id(model):
            # config.json alone first: a model of a family we do not support is refused before its weights (tens
            # of GB for some) are downloaded.
            self._read_config(download_hub_config(model))
        # A gs:// checkpoint's weights are read where they lie (parallel ranged reads); only its small files are cached.
        self.model_dir = resolve_model_dir(model, weights=not from_store)
        self._read_config(self.model_dir / "config.json")
        # Fail on missing files before any device work. A gs:// checkpoint: this machine's copy when it is sound
        # already (the headers read from it, not from the bucket), else the bucket's headers, and the copy made once
        # the step fits (extract/weightcache.py).
        copied = weightcache.reused_checkpoint(model) if from_store else None
        checkpoint = copied or (Checkpoint.from_store(model) if from_store else Checkpoint(self.model_dir))
        self._place(layers, sites, mesh, devices)
        if from_store and copied is None:
            checkpoint = weightcache.open_checkpoint(model)
        self._state = load_state(
            checkpoint, self._abstract_state, self.mesh, self._rules, self._compute_dtype, config=self.config
        )
        self._log_ready(model, time.monotonic() - started)

    @classmethod
    def with_random_weights(
        cls,
        config: ModelConfig,
        layers: Sequence[int],
        *,
        batch_size: int,
        max_seq_len: int,
        compute_dtype: str = "bfloat16",
        out_dtype: str = "bfloat16",
        mesh: str | None = None,
        devices: Sequence[jax.Device] | None = None,
        seed: int = 0,
        attention: str = "auto",
        device_memory: int | None = None,
        sites: dict[str, Sequence[int]] | None = None,
    ) -> Engine:
        """An engine whose weights are drawn on the devices (for benchmarks of models too large to write to disk)."""
        started = time.monotonic()
        engine = cls.__new__(cls)
        engine._configure(batch_size, max_seq_len, compute_dtype, out_dtype, attention, device_memory)
        engine.config = config
        engine._check_positions()
        engine.model_dir = pathlib.Path(tempfile.mkdtemp(prefix="random-model-"))
        (engine.model_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        engine._place(layers, sites, mesh, devices)
        engine._state = engine._random_state(seed)
        engine._log_ready("random", time.monotonic() - started)
        return engine

    # -- construction ----------------------------------------------------------------------------------------------

    def _read_config(self, path: pathlib.Path) -> None:
        """The model's architecture (a BadInput for a family or setting we do not support), and whether it computes
        `max_seq_len` tokens as transformers does."""
        self.config = ModelConfig.from_file(path)
        self._check_positions()

    def _check_positions(self) -> None:
        limit = self.config.max_positions
        if limit is not None and self.max_seq_len > limit:
            raise BadInput(
                f"max_seq_len={self.max_seq_len} is longer than this {self.config.model_type} model computes as its "
                f"reference does ({limit} positions: GPT-2's position table, or LongRoPE's original context, past "
                f"which transformers switches to other frequencies); use max_seq_len {limit} or less"
            )

    def _configure(self, batch_size, max_seq_len, compute_dtype, out_dtype, attention_kernel, device_memory) -> None:
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_seq_len = _positive_int("max_seq_len", max_seq_len)
        self.compute_dtype, self.out_dtype = compute_dtype, out_dtype
        self._compute_dtype = _dtype("compute_dtype", compute_dtype)
        self._out_dtype = _dtype("out_dtype", out_dtype)
        if not isinstance(attention_kernel, str):
            raise BadInput(f"attention={attention_kernel!r} must be 'auto' or one of {', '.join(attention.KERNELS)}")
        self._requested_attention = attention_kernel
        if device_memory is None and os.environ.get(DEVICE_MEMORY_ENV):
            raw = os.environ[DEVICE_MEMORY_ENV]
            if not raw.isdigit():
                raise BadInput(f"${DEVICE_MEMORY_ENV}={raw!r} must be a number of bytes")
            device_memory = int(raw)
        self._memory_override = None if device_memory is None else _positive_int("device_memory", device_memory)
        self._programs: dict[int, jax.stages.Compiled] = {}
        self.compiled_programs = 0

    def _check_expert_indices(self, points: Sequence[HookPoint]) -> None:
        """`expert_indices` holds whole numbers in the output dtype: refused where that dtype cannot hold every
        index exactly (bfloat16 past 256 experts, float16 past 2,048)."""
        exact = {"bfloat16": EXACT_EXPERT_INDICES, "float16": 2048}.get(jnp.dtype(self._out_dtype).name)
        moe = self.config.moe
        if moe is None or exact is None or moe.num_experts <= exact:
            return
        if any(point.site == "expert_indices" for point in points):
            raise BadInput(
                f"sites.expert_indices: out_dtype {self.out_dtype} holds whole numbers exactly only up to {exact}, and "
                f"this model has {moe.num_experts} experts; use float32, or keep expert_weights"
            )

    def _place(self, layers, sites, mesh: str | None, devices) -> None:
        """Choose the mesh and shardings, and build the abstract (shapes-only) model truncated at the deepest layer."""
        points = self.config.hook_points(sites)
        self._check_expert_indices(points)
        self.layers = normalize_layers(layers, self.config.num_hidden_layers, allow_empty=bool(points))
        self.outputs = (*self.layers, *points)
        self.num_computed_layers = self.config.depth_for(self.outputs)
        devices = list(devices) if devices is not None else shd.default_devices()
        if not devices:
            raise BadInput("devices is empty: the engine needs at least one device")
        self.attention = self._choose_attention(devices[0])
        self.device_memory, self._memory_source = self._usable_memory(devices[0])
        if mesh is not None:
            if not isinstance(mesh, str):
                raise BadInput(f"mesh={mesh!r} must be a string such as 'data=2,model=2', or unset")
            shape = shd.parse_mesh(mesh, len(devices))
        else:
            shape = mem.choose_mesh_shape(
                self.config,
                len(devices),
                self.device_memory,
                num_layers=self.num_computed_layers,
                batch_size=self.batch_size,
                seq_len=self.max_seq_len,
                compute_bytes=jnp.dtype(self._compute_dtype).itemsize,
                out_bytes=jnp.dtype(self._out_dtype).itemsize,
                num_outputs=self.config.hidden_units(self.outputs),
            )
        if self.batch_size % shape[0]:
            raise BadInput(
                f"batch_size={self.batch_size} is not a multiple of the mesh's data axis ({shape[0]}): "
                f"use a multiple of {shape[0]}"
            )
        self.mesh = shd.make_mesh(shape, devices)
        self._rules = shd.ShardingRules.for_config(self.config, shape[1])
        self._check_memory(shape)
        heads_split = shd.MODEL in tuple(self._rules.q_proj) and shd.MODEL in tuple(self._rules.kv_proj)
        self._binding = attention.Binding(
            self.attention.kernel, self.mesh, heads_split, interpret=devices[0].platform != "tpu"
        )
        self._token_sharding = NamedSharding(self.mesh, self._rules.tokens)
        self._hidden_sharding = NamedSharding(self.mesh, self._rules.activations)
        config, depth, dtype, mesh_, rules = (
            self.config, self.num_computed_layers, self._compute_dtype, self.mesh, self._rules,
        )  # fmt: skip
        abstract = nnx.eval_shape(lambda: DecoderModel(config, depth, dtype, nnx.Rngs(0), mesh_, rules))
        self._graphdef, self._abstract_state = nnx.split(abstract)

    def _choose_attention(self, device: jax.Device) -> attention.Choice:
        """The attention kernel, decided once for the model and the devices, and logged once."""
        capability = getattr(device, "compute_capability", None)  # "9.0" on an H100; absent off CUDA
        choice = attention.for_model(  # the planner asks the same function (extract/kernel_choice.py)
            device.platform,
            self._compute_dtype,
            self.config,
            requested=self._requested_attention,
            hopper=capability is None or float(capability) >= 9.0,
        )
        log.info(
            "event=attention kernel=%s platform=%s compute_dtype=%s head_dim=%d reason=%r",
            choice.kernel, device.platform, self.compute_dtype, self.config.head_dim, choice.reason,
        )  # fmt: skip
        return choice

    def _usable_memory(self, device: jax.Device) -> tuple[int | None, str]:
        """Bytes one device may use, and where the figure comes from: the override, the runtime, or the cited
        table of HBM per chip (`extract.memory.HBM_BYTES`); None on CPU, whose memory counts as ample."""
        if self._memory_override is not None:
            return self._memory_override, "override"
        reported = shd.device_memory_bytes(device)
        if reported is not None:
            return reported, "memory_stats"
        if device.platform == "cpu":
            return None, "unknown"
        table = mem.usable_bytes(device.device_kind, device.platform)
        return table, "table" if table is not None else "unknown"

    def _step_shape(self, model_axis: int) -> dict:
        """`extract.memory.step_memory`'s arguments for this engine, but rows and seq_len."""
        return dict(
            config=self.config,
            depth=self.num_computed_layers,
            kept=self.config.hidden_units(self.outputs),
            compute_bytes=jnp.dtype(self._compute_dtype).itemsize,
            out_bytes=jnp.dtype(self._out_dtype).itemsize,
            kernel=self.attention.kernel,
            # Packed rows add the same-document mask; the engine learns of packing only at its first batch, so it
            # plans for it (a few percent at most).
            packed=True,
            model_axis=model_axis,
        )

    def _device_name(self) -> str:
        device = self.mesh.devices.flat[0]
        return f"{device.device_kind} ({device.platform}, memory from {self._memory_source})"

    def _check_memory(self, shape: tuple[int, int]) -> None:
        """Refuse, before any weight is read, a batch whose step does not fit one device (DeviceMemoryError)."""
        estimate = mem.check_fits(
            self.device_memory, self._device_name(), batch_size=self.batch_size, data_axis=shape[0],
            max_seq_len=self.max_seq_len, **self._step_shape(shape[1]),
        )  # fmt: skip
        log.info(
            "event=memory_plan device_memory=%s source=%s step=%r",
            self.device_memory, self._memory_source, estimate.describe(),
        )  # fmt: skip

    def memory_error(self, failure: BaseException) -> mem.DeviceMemoryError | None:
        """The knob to turn for an out-of-memory raised by XLA (at compile or run time); None for other errors."""
        if isinstance(failure, mem.DeviceMemoryError):
            return failure
        if not isinstance(failure, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in str(failure):
            return None
        data, model = self.mesh.shape[shd.DATA], self.mesh.shape[shd.MODEL]
        step = mem.step_memory(
            rows=self.batch_size // data, seq_len=self.max_seq_len, **self._step_shape(model)
        )  # fmt: skip
        first_line = str(failure).strip().splitlines()[0][:300]
        return mem.DeviceMemoryError(
            f"out of device memory on {self._device_name()} at batch_size={self.batch_size}, "
            f"max_seq_len={self.max_seq_len} (estimated step {step.describe()}; XLA: {first_line}): lower batch_size "
            "or max_seq_len"
        )

    def _raise_named(self, failure: BaseException) -> None:
        named = self.memory_error(failure)
        if named is not None and named is not failure:
            raise named from failure

    def _param_shardings(self) -> dict:
        shardings: dict = {}
        for path, variable in nnx.to_flat_state(self._abstract_state):
            node = shardings
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = NamedSharding(self.mesh, getattr(self._rules, variable.get_metadata()["role"]))
        return shardings

    def _random_state(self, seed: int) -> nnx.State:
        config, depth, dtype = self.config, self.num_computed_layers, self._compute_dtype

        def init():
            return nnx.to_pure_dict(nnx.state(DecoderModel(config, depth, dtype, nnx.Rngs(seed))))

        values = jax.jit(init, out_shardings=self._param_shardings())()
        nnx.replace_by_pure_dict(self._abstract_state, values)
        return self._abstract_state

    def _log_ready(self, source: str, seconds: float) -> None:
        params = sum(v.size for v in jax.tree.leaves(nnx.to_pure_dict(self._state)))
        log.info(
            "event=engine_ready model=%s model_type=%s outputs=%s computed_layers=%d params=%d mesh=%s "
            "compute_dtype=%s out_dtype=%s batch_size=%d seconds=%.1f",
            source, self.config.model_type, self.outputs_summary(), self.num_computed_layers, params,
            shd.mesh_summary(self.mesh), self.compute_dtype, self.out_dtype, self.batch_size, seconds,
        )  # fmt: skip

    def width(self, output: Output) -> int:
        """Values per token of one output (`ModelConfig.width`)."""
        return self.config.width(output)

    def outputs_summary(self) -> str:
        """The outputs by tensor name, for log lines: `layer_1,layer_4,mlp_out_2`."""
        return ",".join(map(output_key, self.outputs))

    # -- forward ---------------------------------------------------------------------------------------------------

    def _program(self, seq_len: int, packed: bool = False) -> jax.stages.Compiled:
        key = (seq_len, "packed") if packed else seq_len
        program = self._programs.get(key)
        if program is not None:
            return program
        started = time.monotonic()
        graphdef, keep, out_dtype = self._graphdef, self.outputs, self._out_dtype

        def cast(kept: dict) -> tuple[dict, jax.Array]:
            # Keyed by tensor name: a pytree's dict keys are sorted, and ints and hook points do not compare.
            out = {output_key(output): kept[output].astype(out_dtype) for output in keep}
            # Count what the cast to the output dtype makes non-finite (fp16 overflows at 65504), here on the
            # device, where it costs one pass over data already in memory: B*T*outputs counts come back, not values.
            counts = [jnp.sum(~jnp.isfinite(out[output_key(output)]), axis=-1, dtype=jnp.int32) for output in keep]
            return out, jnp.stack(counts, axis=-1)

        def forward(state, token_ids):
            return cast(nnx.merge(graphdef, state)(token_ids, keep))

        def forward_packed(state, token_ids, segment_ids, positions):
            return cast(nnx.merge(graphdef, state)(token_ids, keep, segment_ids, positions))

        tokens = jax.ShapeDtypeStruct((self.batch_size, seq_len), jnp.int32, sharding=self._token_sharding)
        out_shardings = ({output_key(output): self._hidden_sharding for output in keep}, self._hidden_sharding)
        inputs = (tokens, tokens, tokens) if packed else (tokens,)
        jitted = jax.jit(forward_packed if packed else forward, out_shardings=out_shardings)
        # The kernel and the matmul precision are fixed in the program when it is traced, here.
        with self.compile_hook(seq_len, packed, "trace"), attention.use(self._binding), self.matmul_precision():
            lowered = jitted.lower(self._state, *inputs)
        lowered_at = time.monotonic()
        try:
            with self.compile_hook(seq_len, packed, "compile"):
                program = lowered.compile(compiler_options=self.compiler_options())
        except jax.errors.JaxRuntimeError as failure:  # a TPU compile reports an over-sized program itself
            self._raise_named(failure)
            raise
        need = self._compiled_need(program)
        self._programs[key] = program
        self.compiled_programs += 1
        log.info(
            "event=compile seq_len=%d batch_size=%d outputs=%s mesh=%s packed=%s attention=%s device_bytes=%s "
            "seconds=%.2f lower_s=%.2f compile_s=%.2f programs=%d",
            seq_len, self.batch_size, self.outputs_summary(), shd.mesh_summary(self.mesh), packed,
            self.attention.kernel, need, time.monotonic() - started, lowered_at - started,
            time.monotonic() - lowered_at, self.compiled_programs,
        )  # fmt: skip
        return program

    def matmul_precision(self) -> contextlib.AbstractContextManager:
        """HIGHEST for float32 compute: at default precision TPUs multiply float32 in bf16 passes and recent GPUs
        in TF32, which would cost float32 jobs their parity with transformers. Other dtypes keep the default."""
        if self._compute_dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def compiler_options(self) -> dict[str, str] | None:
        """XLA options of this engine's programs: a float32 job on CPU compiles without YNNPACK (None: XLA's defaults).

        XLA:CPU hands dots (and some elementwise and reduce fusions) to YNNPACK by default
        (`DebugOptions.xla_cpu_experimental_ynn_fusion_type`, openxla/xla `xla/xla.proto`: "Fusion types enabled for
        YNNPACK in the library rewriter pass"; an empty list turns them all off). Its float32 dots accumulate
        more loosely once a product has 64 rows or more: at 4,096 inputs a [128, 4096] x [4096, 2048] product is
        1.5e-6 of its largest value off float64, 4.6x torch's error on the same inputs, where XLA's own dot (Eigen)
        is 0.85x it (docs/MODEL.md, "Real widths"; `bench/cpu_matmul.py`). That alone put Qwen3-30B-A3B's width over
        the float32 bound. bf16 jobs keep the default: their results round to bf16 (2^-8), which dwarfs that
        difference. Off a CPU the option does not apply."""
        if self._compute_dtype == jnp.float32 and self.mesh.devices.flat[0].platform == "cpu":
            return {"xla_cpu_experimental_ynn_fusion_type": ""}
        return None

    def _compiled_need(self, program: jax.stages.Compiled) -> int | None:
        """XLA's bytes per device for one step (arguments, outputs, scratch), plus the outputs of earlier steps the
        writer may still hold; a DeviceMemoryError if that exceeds the device's memory."""
        try:
            stats = program.memory_analysis()
        except (NotImplementedError, RuntimeError):  # not every backend reports it
            return None
        if stats is None:
            return None
        step = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        need = int(step - stats.alias_size_in_bytes + mem.HELD_STEPS * stats.output_size_in_bytes)
        data, model = self.mesh.shape[shd.DATA], self.mesh.shape[shd.MODEL]
        mem.check_fits(
            self.device_memory, self._device_name(), batch_size=self.batch_size, data_axis=data,
            max_seq_len=self.max_seq_len, need=need, **self._step_shape(model),
        )  # fmt: skip
        return need

    def forward(
        self, token_ids: np.ndarray, segment_ids: np.ndarray | None = None, positions: np.ndarray | None = None
    ) -> Outputs:
        """{output: [batch_size, T, width] in out_dtype} for an int [batch_size, T] right-padded batch, with the
        non-finite counts (`Outputs`).

        Packed rows (several documents per row) also pass `segment_ids` and `positions`, both [batch_size, T]:
        the document of each token and its position within it (see `extract.batching.pack_window`).
        Returns without waiting for the devices. Every distinct T compiles one program, so callers should use a
        small set of bucket lengths.
        """
        token_ids = np.asarray(token_ids)
        if token_ids.ndim != 2 or token_ids.shape[0] != self.batch_size:
            raise ValueError(f"token_ids has shape {token_ids.shape}; expected [{self.batch_size}, T]")
        seq_len = token_ids.shape[1]
        if not 1 <= seq_len <= self.max_seq_len:
            raise ValueError(f"token_ids length {seq_len} is outside 1..max_seq_len={self.max_seq_len}")
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise ValueError(f"token_ids has dtype {token_ids.dtype}; expected integers")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            # jnp.take would silently return NaN rows for such ids.
            raise BadInput(
                f"token id {high if high >= self.config.vocab_size else low} is outside the model's "
                f"vocab_size={self.config.vocab_size}: the tokenizer does not match the model"
            )
        packed = segment_ids is not None
        shapes = {np.shape(segment_ids), np.shape(positions)} if packed else set()
        if packed and (positions is None or shapes != {token_ids.shape}):
            raise ValueError(f"packed rows need segment_ids and positions of token_ids' shape {token_ids.shape}")
        program = self._program(seq_len, packed)
        put = lambda a: jax.device_put(np.asarray(a).astype(np.int32, copy=False), self._token_sharding)  # noqa: E731
        inputs = (token_ids, segment_ids, positions) if packed else (token_ids,)
        try:
            values, nonfinite = program(self._state, *map(put, inputs))
        except jax.errors.JaxRuntimeError as failure:
            self._raise_named(failure)
            raise
        for array in values.values():
            # Start the device-to-host copy now, so it overlaps the next step instead of following it. Arrays
            # spread over several hosts (a slice) are copied per shard by their writers.
            if array.is_fully_addressable:
                array.copy_to_host_async()
        outputs = Outputs((output, values[output_key(output)]) for output in self.outputs)
        outputs.nonfinite = nonfinite
        return outputs

    # -- accounting ------------------------------------------------------------------------------------------------

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token up to the deepest requested layer (matmuls only, 2 per multiply-add).

        Projections: 2 * (D*N*H + 2*D*K*H + N*H*D + M*D*F) per layer, M the MLP's matrices (3 gated, 2 plain).
        Attention: 2 * 2 * N*H * seq_len per layer for scores and the weighted sum, counted over all seq_len keys
        because that is what runs (the causal mask is applied to a full score matrix). Embedding lookup, norms and
        the final norm are not counted (`extract.costmodel.flops_per_token`, the planner's count).
        """
        return costmodel.flops_per_token(self.config, self.num_computed_layers, seq_len)

    def peak_flops(self) -> float | None:
        """Sum of the mesh devices' dense bf16 peak FLOP/s; None when unknown (CPU, unlisted accelerators)."""
        total = 0.0
        for device in self.mesh.devices.flat:
            peak = device_peak_flops(device)
            if peak is None:
                return None
            total += peak
        return total
