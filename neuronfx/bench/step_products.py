"""The products of one batch-1 decode step, apart from the step: which ops-bundle calls the model
math makes for them (:func:`step_products`, a pure function of the weights and the config) and the
kernel calls those become on the CPU kernel ops (:func:`kernel_calls`), ready to be timed alone
(:func:`time_calls`). ``neuronfx bench step-bound`` times a compiled step against them."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from neuronfx.bench.bandwidth import unique_tensors
from neuronfx.bench.rounds import median
from neuronfx.config.model import ModelConfig
from neuronfx.errors import UnsupportedModelError
from neuronfx.graphs.models.layers import LayerWeights, Weights
from neuronfx.graphs.models.ops import Ops, Weight

KINDS = ("projections", "linear", "head", "glu")
"""The ops-bundle call a product is: ``ops.projections`` (up to three weights against one x),
``ops.linear`` or ``ops.glu`` (SwiGLU's gated product)."""

KERNEL_NAMESPACE = "neuronfx"
"""The namespace of neuronfx's kernel ops (``graphs/kernels/library.py``)."""


@attrs.frozen(kw_only=True, eq=False)
class Product:
    """One ops-bundle call of a decode step's products, as the model math makes it."""

    name: str  # "layers.3.qkv", "layers.3.wo", "layers.3.mlp", "layers.3.down", "lm_head"
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    weights: tuple[Weight, ...]  # float (N, K) tensors or quantized records (graphs/models/quant.py)
    biases: tuple[torch.Tensor | None, ...]  # one per weight for "projections", "linear" and "head"; () for "glu"
    x_shape: tuple[int, ...]  # (1, 1, K) in a layer (B, T, K); (1, K) at the LM head, which takes the last row (B, hidden)


def check_dense(config: ModelConfig) -> None:
    """UnsupportedModelError for a mixture-of-experts model: its products depend on the router's
    choice per token, which a fixed list cannot hold."""
    if config.num_experts > 0:
        raise UnsupportedModelError(
            f"model_type={config.model_type!r} has {config.num_experts} experts per MoE layer; the step's products are "
            "listed for dense models only (llama, mistral, qwen2, qwen3, phi3, granite, gemma3_text, smollm3); use "
            "`neuronfx bench moe` for expert layers.")


def layer_products(prefix: str, lw: LayerWeights, config: ModelConfig) -> list[Product]:
    """The four product calls of one dense decoder layer (``models/llama.py`` and the families
    built from its pieces): Q/K/V in one ``projections`` call (with q/k/v biases when
    ``config.attention_bias``), the output projection, the MLP's gate and up (one ``glu`` call
    for SwiGLU; ``projections`` with their biases when ``config.mlp_bias``, or for another
    activation: gemma3's gelu), and down. The o_proj and down biases are added outside the
    products."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    qkv_biases = (lw["bq"], lw["bk"], lw["bv"]) if config.attention_bias else (None, None, None)
    if config.mlp_bias:
        mlp = Product(name=f"{prefix}.mlp", kind="projections", weights=(lw["gate"], lw["up"]), biases=(lw["bgate"], lw["bup"]),
                      x_shape=(1, 1, h))
    elif config.hidden_act != "silu":
        mlp = Product(name=f"{prefix}.mlp", kind="projections", weights=(lw["gate"], lw["up"]), biases=(None, None), x_shape=(1, 1, h))
    else:
        mlp = Product(name=f"{prefix}.mlp", kind="glu", weights=(lw["gate"], lw["up"]), biases=(), x_shape=(1, 1, h))
    return [
        Product(name=f"{prefix}.qkv", kind="projections", weights=(lw["wq"], lw["wk"], lw["wv"]), biases=qkv_biases, x_shape=(1, 1, h)),
        Product(name=f"{prefix}.wo", kind="linear", weights=(lw["wo"],), biases=(None,), x_shape=(1, 1, q)),
        mlp,
        Product(name=f"{prefix}.down", kind="linear", weights=(lw["down"],), biases=(None,), x_shape=(1, 1, config.intermediate_size)),
    ]


def step_products(weights: Weights, config: ModelConfig) -> tuple[Product, ...]:
    """Every product call of one decode step of a dense model, in the order the graph makes them:
    per layer of ``config.num_hidden_layers`` (:func:`layer_products` on ``weights["layers"][i]``),
    then the LM head (``weights["lm_head"]``, the embedding when tied). ``weights`` are a
    runtime's (``Runtime.weights``, one rank: tp_degree 1). UnsupportedModelError for an MoE
    model (:func:`check_dense`); ValueError when ``weights`` holds another number of layers."""
    check_dense(config)
    if len(weights["layers"]) != config.num_hidden_layers:
        raise ValueError(f"the weights hold {len(weights['layers'])} layers, the config {config.num_hidden_layers}: pass a "
                         "runtime's weights with the config of its plan (plan.model).")
    layers = [p for i in range(config.num_hidden_layers) for p in layer_products(f"layers.{i}", weights["layers"][i], config)]
    head = Product(name="lm_head", kind="head", weights=(weights["lm_head"],), biases=(None,), x_shape=(1, config.hidden_size))
    return (*layers, head)


def products_bytes(products: Sequence[Product]) -> int:
    """Bytes of the weights and biases the products read, each storage once (a tied LM head's
    embedding counted once; quantized records by their data, scales and offsets)."""
    return sum(t.nbytes for t in unique_tensors([(p.weights, p.biases) for p in products]))


@attrs.frozen(kw_only=True, eq=False)
class KernelCall:
    """One kernel op call as a product made it: ``op(*args, **kwargs)`` on the same tensors."""

    product: str  # the Product's name
    op: Any  # torch._ops.OpOverload, e.g. torch.ops.neuronfx.small_gemm_multi.default
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        """The op's name, e.g. "neuronfx::small_glu"."""
        return self.op.name()

    def __call__(self) -> Any:
        return self.op(*self.args, **self.kwargs)


class _KernelRecorder(TorchDispatchMode):
    """While active, runs every dispatched op and keeps the product ops' calls: neuronfx's kernels
    and torch's ``_int_mm`` (int8 weights with int8 activations, ``int8_x.w8a8_linear``)."""

    def __init__(self, product: str) -> None:
        super().__init__()
        self.product = product
        self.calls: list[KernelCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == KERNEL_NAMESPACE or func is torch.ops.aten._int_mm.default:  # _int_mm: int8 weights' integer GEMM
            self.calls.append(KernelCall(product=self.product, op=func, args=args, kwargs=kwargs))
        return func(*args, **kwargs)


def recorded_kernel_calls(fn: Callable[[], Any], label: str = "") -> list[KernelCall]:
    """The neuronfx kernel op calls ``fn()`` dispatches, in order, each labelled ``label``
    (``fn`` runs once, for real: e.g. a product through an ops bundle, or a whole decode graph)."""
    with torch.no_grad(), _KernelRecorder(label) as recorder:
        fn()
    return recorder.calls


def call_product(ops: Ops, product: Product, x: torch.Tensor) -> Any:
    """``product`` through ``ops`` on x of ``product.x_shape``: the call the model math makes."""
    if product.kind == "projections":
        return ops.projections(x, product.weights, product.biases)
    if product.kind == "glu":
        return ops.glu(x, *product.weights)
    if product.kind == "head":
        return ops.head_linear(x, product.weights[0], product.biases[0])
    return ops.linear(x, product.weights[0], product.biases[0])


def kernel_calls(products: Sequence[Product], ops: Ops, dtype: torch.dtype, seed: int = 0) -> tuple[KernelCall, ...]:
    """The kernel op calls of ``products`` for one row of x: each product runs once through
    ``ops`` (the plan's bundle, ``kernels.bundles.cpu_kernel_ops(dtype, int8_paths)``:
    so the kernel is chosen exactly as in the compiled graph) on x of its ``x_shape`` and ``dtype`` drawn
    from N(0, 1) with ``seed``, and every neuronfx op it dispatches is kept with its arguments.
    Replaying them skips the bundle's Python (shape checks, list building, output views): a
    couple of us per product that a compiled graph does not pay. ValueError when a product
    dispatches no kernel op (the kernel library is off: the bundle fell back to torch)."""
    g = torch.Generator().manual_seed(seed)
    xs = {shape: torch.randn(shape, generator=g).to(dtype) for shape in sorted({p.x_shape for p in products})}
    out: list[KernelCall] = []
    for p in products:
        calls = recorded_kernel_calls(lambda p=p: call_product(ops, p, xs[p.x_shape]), p.name)
        if not calls:
            raise ValueError(f"product {p.name} ({p.kind}) through ops {ops.name} called no neuronfx kernel: the kernel "
                             "library is unavailable (NEURONFX_KERNELS=0 or no C++ compiler), so there are no kernel products.")
        out += calls
    return tuple(out)


def time_calls(calls: Sequence[KernelCall], steps: int) -> float:
    """Median seconds of ``steps`` passes over every call (one pass: one step's products); each
    call is bound to its arguments first, so a pass costs the ops' own dispatch and no more."""
    bound = [functools.partial(c.op, *c.args, **c.kwargs) for c in calls]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for fn in bound:
            fn()
        times.append(time.perf_counter() - t0)
    return median(times)
