"""Every entry point of fusekit._C: a valid call on the CPU backend (NumPy arrays) and the kind of
each of its arguments, for the argument tests (test_numpy_arguments.py) and the fuzzing of mistyped
scalars (test_fuzz.py).

The list of entry points and of their arguments is read from the module and its signatures, and
test_every_entry_point_and_argument_is_covered fails for any function or argument without a row
here: a new entry point cannot go untested silently.

For each scalar kind, PROBES gives values of a wrong Python type (must raise ArgumentTypeError, a
TypeError, naming the op and the argument), values of the right type that the C++ type cannot hold
(must raise InvalidArgumentError naming them) and accepted alternatives, such as NumPy scalars, with
the plain Python value they must behave exactly like."""
import math
import re

import numpy as np

import fusekit
from fusekit import _C

try:
    import ml_dtypes
except ImportError:  # the FP8 entry points are then only checked for coverage
    ml_dtypes = None

# Argument kinds: how the binding converts the argument.
ARRAY = "array"          # an array, None where optional, 'auto' for a workspace (other tests)
ARRAYS = "arrays"        # a list or tuple of arrays (the multi-tensor ops; test_numpy_optim.py)
FLOAT = "float"          # float32: float, int or NumPy real scalar
OPT_FLOAT = "float?"     # FLOAT or None
INT64 = "int64"
INT32 = "int32"
UINT64 = "uint64"
BOOL = "bool"
DTYPE = "dtype"          # fusekit.DType
DEVICE = "device"        # 'cpu', 'cuda', 'cuda:N'
ACTIVATION = "activation"  # fusekit.Activation or its name
MASK = "mask"            # fusekit.AttentionMask or its name
REDUCTION = "reduction"  # fusekit.LossReduction or its name
LAYOUT = "layout"        # fusekit.GatedLayout or its name
STYLE = "style"          # fusekit.RopeStyle or its name
STREAM = "stream"        # None or an int holding a cudaStream_t
CFG = "cfg"              # fusekit.torch's attention config tuple

SCALAR_KINDS = (FLOAT, OPT_FLOAT, INT64, INT32, UINT64, BOOL, DTYPE, DEVICE, ACTIVATION, MASK,
                REDUCTION, LAYOUT, STYLE, STREAM, CFG)
#: The option kinds: argument kind -> the fusekit enum whose members (or their names) it takes.
OPTIONS = {ACTIVATION: fusekit.Activation, MASK: fusekit.AttentionMask, REDUCTION: fusekit.LossReduction,
           LAYOUT: fusekit.GatedLayout, STYLE: fusekit.RopeStyle}


class EntryPoint:
    """name: the function of fusekit._C; op: the name its errors carry; kinds: argument -> kind, in
    signature order; make(rng): keyword arguments of a valid call (fresh arrays); expect: what the
    valid call does on this machine ('ok', or the fusekit error class it raises: the private
    bindings that allocate outputs need PyTorch's allocator)."""

    def __init__(self, name, kinds, make, expect="ok", needs_ml_dtypes=False):
        self.name, self.kinds, self.make = name, kinds, make
        self.op = name[1:-len("_alloc")] if name.startswith("_") and name.endswith("_alloc") else name
        self.expect, self.needs_ml_dtypes = expect, needs_ml_dtypes

    @property
    def function(self):
        return getattr(_C, self.name)

    def scalars(self):
        return [a for a, k in self.kinds.items() if k not in (ARRAY, ARRAYS)]

    def available(self):
        return ml_dtypes is not None or not self.needs_ml_dtypes


def module_entry_points():
    """Every function of fusekit._C (public and private), from the module itself."""
    nb_func = type(_C.version)
    return sorted(n for n in dir(_C) if not n.startswith("__") and isinstance(getattr(_C, n), nb_func))


def signature_arguments(function):
    """The argument names of a nanobind function, in order, from its signature."""
    text = function.__nb_signature__[0][0]
    inner = text[text.index("(") + 1:text.rindex(") ->")]
    names = []
    for part in inner.split(", "):
        part = part.strip()
        if part and part not in ("*", "/"):
            names.append(re.match(r"\w+", part).group(0))
    return names


# ---- valid calls ---------------------------------------------------------------------------------
def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def out(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype)


def norm_inputs(rng):
    return dict(x=f32(rng, 2, 8) + 0.5, weight=rng.uniform(0.5, 1.5, 8).astype(np.float32))


def _layer_norm_forward(rng):
    return dict(norm_inputs(rng), bias=f32(rng, 8), eps=1e-5, y=out(2, 8), mean=out(2), rstd=out(2),
                stream=None)


def _rms_norm_forward(rng):
    return dict(norm_inputs(rng), eps=1e-5, y=out(2, 8), rstd=out(2), stream=None)


def _norm_backward(rng, source, with_mean, with_bias):
    a = dict(dy=f32(rng, 2, 8), **{source: f32(rng, 2, 8)}, weight=norm_inputs(rng)["weight"])
    if with_mean:
        a["mean"] = f32(rng, 2)
    if with_bias == "input":
        a["bias"] = f32(rng, 8)
    a["rstd"] = rng.uniform(0.5, 2, 2).astype(np.float32)
    a.update(dx=out(2, 8), dweight=out(8))
    if with_bias == "grad" or with_bias == "input":
        a["dbias"] = out(8)
    a.update(workspace=None, stream=None)
    return a


def _norm_residual_forward(rng, with_mean_and_bias):
    a = dict(norm_inputs(rng), residual=f32(rng, 2, 8))
    a = dict(x=a["x"], residual=a["residual"], weight=a["weight"])
    if with_mean_and_bias:
        a["bias"] = f32(rng, 8)
    a.update(eps=1e-5, y=out(2, 8), sum=out(2, 8))
    if with_mean_and_bias:
        a["mean"] = out(2)
    a.update(rstd=out(2), stream=None)
    return a


def _norm_residual_backward(rng, with_mean_and_bias):
    a = dict(dy=f32(rng, 2, 8), sum=f32(rng, 2, 8), dsum=f32(rng, 2, 8), weight=norm_inputs(rng)["weight"])
    if with_mean_and_bias:
        a["mean"] = f32(rng, 2)
    a["rstd"] = rng.uniform(0.5, 2, 2).astype(np.float32)
    a.update(dx=out(2, 8), dweight=out(8))
    if with_mean_and_bias:
        a["dbias"] = out(8)
    a.update(workspace=None, stream=None)
    return a


def _bias_act(rng):
    return dict(activation="leaky_relu", p=0.5, seed=3, offset=5)


def _dropout_forward(rng):
    x = f32(rng, 2, 8)
    return dict(x=x, bias=f32(rng, 8), **_bias_act(rng), y=out(2, 8), pre_activation=out(2, 8),
                slope=0.01, stream=None)


def _dropout_backward(rng):
    return dict(dy=f32(rng, 2, 8), x=f32(rng, 2, 8), bias=f32(rng, 8), **_bias_act(rng),
                dx=out(2, 8), dbias=out(8), workspace=None, slope=0.01, stream=None)


def _linear_arrays(rng):
    return dict(x=f32(rng, 2, 8), weight=f32(rng, 4, 8))


def _linear_forward(rng):
    return dict(_linear_arrays(rng), bias=f32(rng, 4), activation="gelu_tanh", y=out(2, 4),
                pre_activation=out(2, 4), workspace=None, stream=None)


def _linear_backward(rng):
    a = _linear_arrays(rng)
    return dict(dout=f32(rng, 2, 4), **a, pre_activation=f32(rng, 2, 4), activation="gelu_tanh",
                dx=out(2, 8), dweight=out(4, 8), dbias=out(4), workspace=None, stream=None)


def _linear_backward_through_input_activation(rng):
    a = _linear_arrays(rng)
    return dict(dout=f32(rng, 2, 4), **a, pre_activation=None, activation="none",
                x_pre_activation=f32(rng, 2, 8), x_activation="gelu_tanh", dx_pre_activation=out(2, 8),
                dx_pre_activation_sum=out(8), dweight=out(4, 8), dbias=out(4), workspace=None, stream=None)


def _gated_linear_arrays(rng):
    return dict(x=f32(rng, 2, 8), weight=f32(rng, 6, 8))


def _gated_linear_forward(rng):
    return dict(_gated_linear_arrays(rng), bias=f32(rng, 6), activation="silu", y=out(2, 3),
                pre_activation=out(2, 6), workspace=None, layout="halves", stream=None)


def _gated_linear_backward(rng):
    return dict(dy=f32(rng, 2, 3), **_gated_linear_arrays(rng), pre_activation=f32(rng, 2, 6),
                activation="gelu_tanh", dx=out(2, 8), dweight=out(6, 8), dbias=out(6), workspace=None,
                layout="interleaved", stream=None)


def _fp8_inputs(rng):
    e4m3 = ml_dtypes.float8_e4m3fn
    return dict(x=rng.uniform(-4, 4, (2, 16)).astype(e4m3),
                x_scales=rng.uniform(0.5, 2, (2, 4)).astype(np.float32),
                weight=rng.uniform(0.5, 1.5, 16).astype(np.float32))


def _fp8_forward(rng):
    e4m3 = ml_dtypes.float8_e4m3fn
    return dict(_fp8_inputs(rng), eps=1e-5, qy=np.zeros((2, 16), e4m3), qy_t=np.zeros((16, 2), e4m3),
                y_scale=out(1), rstd=out(2), y=np.zeros((2, 16), ml_dtypes.bfloat16), workspace=None,
                group_size=4, stream=None)


def _fp8_backward(rng):
    bf16 = ml_dtypes.bfloat16
    a = _fp8_inputs(rng)
    return dict(dy=f32(rng, 2, 16).astype(bf16), **a, rstd=rng.uniform(0.5, 2, 2).astype(np.float32),
                dx=np.zeros((2, 16), bf16), dweight=out(16), workspace=None, group_size=4, stream=None)


def _qkv(rng):
    return dict(q=f32(rng, 1, 3, 2, 8), k=f32(rng, 1, 5, 1, 8), v=f32(rng, 1, 5, 1, 8))


def _attention_config():
    return dict(scale=None, mask="causal_bottom_right", window_left=2, window_right=-1,
                dropout_p=0.25, seed=3, offset=5, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=0, max_seqlen_k=0)


def _cfg_tuple():
    c = _attention_config()
    return (c["scale"], c["mask"], c["window_left"], c["window_right"], c["dropout_p"], c["seed"],
            c["offset"], c["max_seqlen_q"], c["max_seqlen_k"])


#: The names the items of the cfg tuple carry in errors, in order.
CFG_ITEMS = (("scale", OPT_FLOAT), ("mask", MASK), ("window_left", INT64), ("window_right", INT64),
             ("dropout_p", FLOAT), ("seed", UINT64), ("offset", UINT64), ("max_seqlen_q", INT64),
             ("max_seqlen_k", INT64))


def _attention_forward(rng):
    return dict(_qkv(rng), bias=None, out=out(1, 3, 2, 8), lse=out(1, 2, 3), **_attention_config(),
                workspace=None, stream=None)


def _attention_backward_arrays(rng):
    return dict(dout=f32(rng, 1, 3, 2, 8), **_qkv(rng), out=f32(rng, 1, 3, 2, 8),
                lse=rng.uniform(1, 2, (1, 2, 3)).astype(np.float32), bias=None, dq=out(1, 3, 2, 8),
                dk=out(1, 5, 1, 8), dv=out(1, 5, 1, 8), dbias=None)


def _attention_backward(rng):
    return dict(_attention_backward_arrays(rng), **_attention_config(), deterministic=False,
                workspace=None, stream=None)


def _xent_inputs(rng):
    targets = rng.integers(0, 6, 4)
    targets[1] = -100  # one ignored row
    return dict(logits=f32(rng, 4, 6), targets=targets)


def _xent_config():
    return dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)


def _xent_forward(rng):
    return dict(_xent_inputs(rng), reduction="mean", loss=out(1), lse=out(4), workspace=None,
                **_xent_config(), stream=None)


def _xent_backward(rng):
    a = _xent_inputs(rng)
    return dict(dloss=f32(rng, 4), **a, lse=rng.uniform(1, 2, 4).astype(np.float32), reduction="none",
                dlogits=out(4, 6), workspace=None, **_xent_config(), stream=None)


def _xent_forward_backward(rng):
    return dict(_xent_inputs(rng), reduction="sum", loss=out(1), dlogits=out(4, 6), lse=out(4),
                workspace=None, **_xent_config(), stream=None)


def _lxent(rng):
    targets = rng.integers(0, 6, 4)
    targets[1] = -100  # one ignored row
    return dict(h=f32(rng, 4, 3), weight=f32(rng, 6, 3), bias=f32(rng, 6), targets=targets, reduction="mean",
                loss=out(1), dh=out(4, 3), dweight=out(6, 3), dbias=out(6), workspace=None, **_xent_config(),
                stream=None)


def _adamw(rng):
    shapes = [(3, 4), (5,)]
    return dict(params=[f32(rng, *s) for s in shapes], grads=[f32(rng, *s) for s in shapes],
                exp_avg=[np.zeros(s, np.float32) for s in shapes], exp_avg_sq=[np.zeros(s, np.float32) for s in shapes],
                param_copies=None, grad_norm=np.array([2.5], np.float32), lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, step=1, max_grad_norm=1.0, stream=None)


def _embedding_forward(rng):
    return dict(tokens=rng.integers(0, 7, (2, 3)), weight=f32(rng, 7, 4), position_weight=f32(rng, 5, 4),
                out=out(2, 3, 4), stream=None)


def _embedding_backward(rng):
    return dict(dout=f32(rng, 2, 3, 4), tokens=rng.integers(0, 7, (2, 3)).astype(np.int32), dweight=out(7, 4),
                dposition_weight=out(5, 4), accumulate=False, workspace=None, stream=None)


def _gated_forward(rng):
    return dict(gate_up=f32(rng, 2, 8), activation="silu", y=out(2, 4), layout="interleaved", stream=None)


def _gated_backward(rng):
    return dict(dy=f32(rng, 2, 4), gate_up=f32(rng, 2, 8), activation="gelu_tanh", dgate_up=out(2, 8),
                layout="halves", in_place_backward=False, stream=None)


def _gated_separate(rng):
    return dict(gate=f32(rng, 2, 4), up=f32(rng, 2, 4))


def _gated_forward_separate(rng):
    return dict(_gated_separate(rng), activation="relu", y=out(2, 4), stream=None)


def _gated_backward_separate(rng):
    return dict(dy=f32(rng, 2, 4), **_gated_separate(rng), activation="silu", dgate=out(2, 4),
                dup=out(2, 4), in_place_backward=False, stream=None)


def _rope_config():
    return dict(style="interleaved", rotary_dim=4, theta=10000.0, linear_scaling=2.0,
                attention_scaling=0.5, inv_freq=None, cos=None, sin=None, stream=None)


def _rope_forward(rng):
    return dict(q=f32(rng, 1, 3, 2, 8), k=f32(rng, 1, 3, 1, 8), position_ids=rng.integers(0, 9, (1, 3)),
                q_out=out(1, 3, 2, 8), k_out=out(1, 3, 1, 8), **_rope_config())


def _rope_backward(rng):
    return dict(dq_out=f32(rng, 1, 3, 2, 8), dk_out=f32(rng, 1, 3, 1, 8), position_ids=None,
                dq=out(1, 3, 2, 8), dk=out(1, 3, 1, 8), **_rope_config())


def _sizes():
    return dict(batch=1, seqlen_q=3, seqlen_k=5, heads_q=2, heads_kv=1, head_dim=8, head_dim_v=8)


ROW_QUERY = dict(rows=INT64, cols=INT64, dtype=DTYPE, device=DEVICE)
SIZES = {name: INT64 for name in _sizes()}
CONFIG = dict(scale=OPT_FLOAT, mask=MASK, window_left=INT64, window_right=INT64, dropout_p=FLOAT,
              seed=UINT64, offset=UINT64, cu_seqlens_q=ARRAY, cu_seqlens_k=ARRAY, max_seqlen_q=INT64,
              max_seqlen_k=INT64)
XENT_CONFIG = dict(ignore_index=INT64, label_smoothing=FLOAT, z_loss=FLOAT)
ROPE_CONFIG = dict(style=STYLE, rotary_dim=INT64, theta=FLOAT, linear_scaling=FLOAT, attention_scaling=FLOAT,
                   inv_freq=ARRAY, cos=ARRAY, sin=ARRAY)
UNSUPPORTED = "UnsupportedError"  # expect: the private bindings allocate through PyTorch only


def _kinds(**kinds):
    return kinds


ENTRY_POINTS = [
    # runtime
    EntryPoint("cuda_device_count", {}, lambda rng: {}),
    EntryPoint("built_cuda_architectures", {}, lambda rng: {}),
    EntryPoint("version", {}, lambda rng: {}),
    EntryPoint("describe_cuda_device", _kinds(device_index=INT32), lambda rng: dict(device_index=0),
               expect="ok" if _C.cuda_device_count() > 0 else "InvalidArgumentError"),
    EntryPoint("cuda_device_supported", _kinds(device_index=INT32), lambda rng: dict(device_index=0)),
    EntryPoint("supports_compute_capability", _kinds(major=INT32, minor=INT32),
               lambda rng: dict(major=9, minor=0)),
    EntryPoint("tensor_info", _kinds(array=ARRAY), lambda rng: dict(array=f32(rng, 2, 3))),
    # norm
    EntryPoint("layer_norm_forward",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, eps=FLOAT, y=ARRAY, mean=ARRAY, rstd=ARRAY,
                      stream=STREAM), _layer_norm_forward),
    EntryPoint("rms_norm_forward",
               _kinds(x=ARRAY, weight=ARRAY, eps=FLOAT, y=ARRAY, rstd=ARRAY, stream=STREAM),
               _rms_norm_forward),
    EntryPoint("_layer_norm_forward_alloc",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, eps=FLOAT, y=ARRAY, stream=STREAM),
               lambda rng: {k: v for k, v in _layer_norm_forward(rng).items() if k not in ("mean", "rstd")},
               expect=UNSUPPORTED),
    EntryPoint("_rms_norm_forward_alloc",
               _kinds(x=ARRAY, weight=ARRAY, eps=FLOAT, y=ARRAY, stream=STREAM),
               lambda rng: {k: v for k, v in _rms_norm_forward(rng).items() if k != "rstd"},
               expect=UNSUPPORTED),
    EntryPoint("norm_backward_workspace_size", ROW_QUERY,
               lambda rng: dict(rows=4, cols=8, dtype=fusekit.DType.f32, device="cpu")),
    EntryPoint("layer_norm_backward",
               _kinds(dy=ARRAY, x=ARRAY, weight=ARRAY, mean=ARRAY, rstd=ARRAY, dx=ARRAY, dweight=ARRAY,
                      dbias=ARRAY, workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_backward(rng, "x", True, "grad")),
    EntryPoint("layer_norm_backward_from_output",
               _kinds(dy=ARRAY, y=ARRAY, weight=ARRAY, bias=ARRAY, rstd=ARRAY, dx=ARRAY, dweight=ARRAY,
                      dbias=ARRAY, workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_backward(rng, "y", False, "input")),
    EntryPoint("rms_norm_backward",
               _kinds(dy=ARRAY, x=ARRAY, weight=ARRAY, rstd=ARRAY, dx=ARRAY, dweight=ARRAY,
                      workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_backward(rng, "x", False, None)),
    EntryPoint("rms_norm_backward_from_output",
               _kinds(dy=ARRAY, y=ARRAY, weight=ARRAY, rstd=ARRAY, dx=ARRAY, dweight=ARRAY,
                      workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_backward(rng, "y", False, None)),
    EntryPoint("layer_norm_residual_forward",
               _kinds(x=ARRAY, residual=ARRAY, weight=ARRAY, bias=ARRAY, eps=FLOAT, y=ARRAY, sum=ARRAY,
                      mean=ARRAY, rstd=ARRAY, stream=STREAM),
               lambda rng: _norm_residual_forward(rng, True)),
    EntryPoint("rms_norm_residual_forward",
               _kinds(x=ARRAY, residual=ARRAY, weight=ARRAY, eps=FLOAT, y=ARRAY, sum=ARRAY, rstd=ARRAY,
                      stream=STREAM),
               lambda rng: _norm_residual_forward(rng, False)),
    EntryPoint("layer_norm_residual_backward",
               _kinds(dy=ARRAY, sum=ARRAY, dsum=ARRAY, weight=ARRAY, mean=ARRAY, rstd=ARRAY, dx=ARRAY,
                      dweight=ARRAY, dbias=ARRAY, workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_residual_backward(rng, True)),
    EntryPoint("rms_norm_residual_backward",
               _kinds(dy=ARRAY, sum=ARRAY, dsum=ARRAY, weight=ARRAY, rstd=ARRAY, dx=ARRAY, dweight=ARRAY,
                      workspace=ARRAY, stream=STREAM),
               lambda rng: _norm_residual_backward(rng, False)),
    # bias + activation + dropout
    EntryPoint("bias_act_dropout_forward",
               _kinds(x=ARRAY, bias=ARRAY, activation=ACTIVATION, p=FLOAT, seed=UINT64, offset=UINT64,
                      y=ARRAY, pre_activation=ARRAY, slope=FLOAT, stream=STREAM), _dropout_forward),
    EntryPoint("bias_act_dropout_backward_workspace_size", ROW_QUERY,
               lambda rng: dict(rows=4, cols=8, dtype=fusekit.DType.f16, device="cpu")),
    EntryPoint("bias_act_dropout_backward",
               _kinds(dy=ARRAY, x=ARRAY, bias=ARRAY, activation=ACTIVATION, p=FLOAT, seed=UINT64,
                      offset=UINT64, dx=ARRAY, dbias=ARRAY, workspace=ARRAY, slope=FLOAT, stream=STREAM),
               _dropout_backward),
    EntryPoint("dropout_keep_mask", _kinds(seed=UINT64, offset=UINT64, p=FLOAT, mask=ARRAY),
               lambda rng: dict(seed=3, offset=2**40, p=0.5, mask=out(16, dtype=np.uint8))),
    # linear
    EntryPoint("linear_forward_workspace_size",
               _kinds(m=INT64, n=INT64, k=INT64, dtype=DTYPE, activation=ACTIVATION, device=DEVICE),
               lambda rng: dict(m=2, n=4, k=8, dtype=fusekit.DType.bf16, activation="relu", device="cpu")),
    EntryPoint("linear_backward_workspace_size",
               _kinds(m=INT64, n=INT64, k=INT64, dtype=DTYPE, activation=ACTIVATION, device=DEVICE),
               lambda rng: dict(m=2, n=4, k=8, dtype=fusekit.DType.bf16, activation="relu", device="cpu")),
    EntryPoint("linear_forward",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, activation=ACTIVATION, y=ARRAY,
                      pre_activation=ARRAY, workspace=ARRAY, stream=STREAM), _linear_forward),
    EntryPoint("_linear_forward_alloc",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, activation=ACTIVATION, save_pre_activation=BOOL),
               lambda rng: dict(_linear_arrays(rng), bias=f32(rng, 4), activation="relu",
                                save_pre_activation=True), expect=UNSUPPORTED),
    EntryPoint("_linear_backward_alloc",
               _kinds(dout=ARRAY, x=ARRAY, weight=ARRAY, pre_activation=ARRAY, activation=ACTIVATION,
                      need_dx=BOOL, need_dweight=BOOL, need_dbias=BOOL),
               lambda rng: dict(dout=f32(rng, 2, 4), **_linear_arrays(rng), pre_activation=f32(rng, 2, 4),
                                activation="relu", need_dx=True, need_dweight=False, need_dbias=True),
               expect=UNSUPPORTED),
    EntryPoint("linear_backward",
               _kinds(dout=ARRAY, x=ARRAY, weight=ARRAY, pre_activation=ARRAY, activation=ACTIVATION,
                      dx=ARRAY, dweight=ARRAY, dbias=ARRAY, workspace=ARRAY, stream=STREAM),
               _linear_backward),
    EntryPoint("linear_backward_through_input_activation_workspace_size",
               _kinds(m=INT64, n=INT64, k=INT64, dtype=DTYPE, activation=ACTIVATION, device=DEVICE),
               lambda rng: dict(m=2, n=4, k=8, dtype=fusekit.DType.bf16, activation="none", device="cpu")),
    EntryPoint("linear_backward_through_input_activation",
               _kinds(dout=ARRAY, x=ARRAY, weight=ARRAY, pre_activation=ARRAY, activation=ACTIVATION,
                      x_pre_activation=ARRAY, x_activation=ACTIVATION, dx_pre_activation=ARRAY,
                      dx_pre_activation_sum=ARRAY, dweight=ARRAY, dbias=ARRAY, workspace=ARRAY, stream=STREAM),
               _linear_backward_through_input_activation),
    EntryPoint("gated_linear_forward_workspace_size",
               _kinds(m=INT64, f=INT64, k=INT64, dtype=DTYPE, activation=ACTIVATION, keeps_pre=BOOL,
                      device=DEVICE, layout=LAYOUT),
               lambda rng: dict(m=2, f=3, k=8, dtype=fusekit.DType.bf16, activation="silu", keeps_pre=False,
                                device="cpu", layout="halves")),
    EntryPoint("gated_linear_backward_workspace_size",
               _kinds(m=INT64, f=INT64, k=INT64, dtype=DTYPE, activation=ACTIVATION, device=DEVICE,
                      layout=LAYOUT),
               lambda rng: dict(m=2, f=3, k=8, dtype=fusekit.DType.f32, activation="relu", device="cpu",
                                layout="interleaved")),
    EntryPoint("gated_linear_forward",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, activation=ACTIVATION, y=ARRAY, pre_activation=ARRAY,
                      workspace=ARRAY, layout=LAYOUT, stream=STREAM), _gated_linear_forward),
    EntryPoint("gated_linear_backward",
               _kinds(dy=ARRAY, x=ARRAY, weight=ARRAY, pre_activation=ARRAY, activation=ACTIVATION, dx=ARRAY,
                      dweight=ARRAY, dbias=ARRAY, workspace=ARRAY, layout=LAYOUT, stream=STREAM),
               _gated_linear_backward),
    EntryPoint("_gated_linear_forward_alloc",
               _kinds(x=ARRAY, weight=ARRAY, bias=ARRAY, activation=ACTIVATION, layout=LAYOUT,
                      save_pre_activation=BOOL),
               lambda rng: dict(_gated_linear_arrays(rng), bias=None, activation="gelu_erf", layout="interleaved",
                                save_pre_activation=True), expect=UNSUPPORTED),
    EntryPoint("_gated_linear_backward_alloc",
               _kinds(dy=ARRAY, x=ARRAY, weight=ARRAY, pre_activation=ARRAY, activation=ACTIVATION, layout=LAYOUT,
                      need_dx=BOOL, need_dweight=BOOL, need_dbias=BOOL),
               lambda rng: dict(dy=f32(rng, 2, 3), **_gated_linear_arrays(rng), pre_activation=f32(rng, 2, 6),
                                activation="silu", layout="halves", need_dx=False, need_dweight=True,
                                need_dbias=True), expect=UNSUPPORTED),
    # FP8 RMSNorm
    EntryPoint("fp8_rms_norm_forward_workspace_size", _kinds(rows=INT64, cols=INT64, device=DEVICE),
               lambda rng: dict(rows=4, cols=64, device="cpu")),
    EntryPoint("fp8_rms_norm_backward_workspace_size", _kinds(rows=INT64, cols=INT64, device=DEVICE),
               lambda rng: dict(rows=4, cols=64, device="cpu")),
    EntryPoint("fp8_rms_norm_forward",
               _kinds(x=ARRAY, x_scales=ARRAY, weight=ARRAY, eps=FLOAT, qy=ARRAY, qy_t=ARRAY,
                      y_scale=ARRAY, rstd=ARRAY, y=ARRAY, workspace=ARRAY, group_size=INT32,
                      stream=STREAM), _fp8_forward, needs_ml_dtypes=True),
    EntryPoint("_fp8_rms_norm_forward_alloc",
               _kinds(x=ARRAY, x_scales=ARRAY, weight=ARRAY, eps=FLOAT, group_size=INT32, qy_dtype=DTYPE,
                      rstd_tensor=BOOL),
               lambda rng: dict(_fp8_inputs(rng), eps=1e-5, group_size=4, qy_dtype=fusekit.DType.f8e4m3,
                                rstd_tensor=False), expect=UNSUPPORTED, needs_ml_dtypes=True),
    EntryPoint("_fp8_rms_norm_backward_alloc",
               _kinds(dy=ARRAY, x=ARRAY, x_scales=ARRAY, weight=ARRAY, rstd=ARRAY, group_size=INT32,
                      need_dx=BOOL, need_dweight=BOOL),
               lambda rng: {k: v for k, v in _fp8_backward(rng).items()
                            if k not in ("dx", "dweight", "workspace", "stream")}
               | dict(need_dx=True, need_dweight=True), expect=UNSUPPORTED, needs_ml_dtypes=True),
    EntryPoint("fp8_rms_norm_backward",
               _kinds(dy=ARRAY, x=ARRAY, x_scales=ARRAY, weight=ARRAY, rstd=ARRAY, dx=ARRAY,
                      dweight=ARRAY, workspace=ARRAY, group_size=INT32, stream=STREAM),
               _fp8_backward, needs_ml_dtypes=True),
    # attention
    EntryPoint("attention_forward_workspace_size",
               dict(SIZES, dtype=DTYPE, device=DEVICE, bias_gradient=BOOL),
               lambda rng: dict(_sizes(), dtype=fusekit.DType.f32, device="cpu", bias_gradient=False)),
    EntryPoint("attention_backward_workspace_size",
               dict(SIZES, dtype=DTYPE, device=DEVICE, deterministic=BOOL, bias_gradient=BOOL),
               lambda rng: dict(_sizes(), dtype=fusekit.DType.f32, device="cpu", deterministic=True,
                                bias_gradient=False)),
    EntryPoint("attention_forward",
               dict(_kinds(q=ARRAY, k=ARRAY, v=ARRAY, bias=ARRAY, out=ARRAY, lse=ARRAY), **CONFIG,
                    workspace=ARRAY, stream=STREAM), _attention_forward),
    EntryPoint("attention_backward",
               dict(_kinds(dout=ARRAY, q=ARRAY, k=ARRAY, v=ARRAY, out=ARRAY, lse=ARRAY, bias=ARRAY,
                           dq=ARRAY, dk=ARRAY, dv=ARRAY, dbias=ARRAY), **CONFIG, deterministic=BOOL,
                    workspace=ARRAY, stream=STREAM), _attention_backward),
    EntryPoint("_attention_forward_alloc",
               _kinds(q=ARRAY, k=ARRAY, v=ARRAY, bias=ARRAY, out=ARRAY, cfg=CFG, cu_seqlens_q=ARRAY,
                      cu_seqlens_k=ARRAY),
               lambda rng: dict(_qkv(rng), bias=None, out=out(1, 3, 2, 8), cfg=_cfg_tuple(),
                                cu_seqlens_q=None, cu_seqlens_k=None), expect=UNSUPPORTED),
    EntryPoint("_attention_backward_alloc",
               _kinds(dout=ARRAY, q=ARRAY, k=ARRAY, v=ARRAY, out=ARRAY, lse=ARRAY, bias=ARRAY, dq=ARRAY,
                      dk=ARRAY, dv=ARRAY, dbias=ARRAY, cfg=CFG, cu_seqlens_q=ARRAY, cu_seqlens_k=ARRAY,
                      deterministic=BOOL),
               lambda rng: dict(_attention_backward_arrays(rng), cfg=_cfg_tuple(), cu_seqlens_q=None,
                                cu_seqlens_k=None, deterministic=False)),
    EntryPoint("attention_dropout_keep_mask", _kinds(seed=UINT64, offset=UINT64, p=FLOAT, mask=ARRAY),
               lambda rng: dict(seed=3, offset=5, p=0.25, mask=out(1, 2, 3, 5, dtype=np.uint8))),
    # cross-entropy
    EntryPoint("cross_entropy_workspace_size",
               _kinds(rows=INT64, classes=INT64, reduction=REDUCTION, device=DEVICE),
               lambda rng: dict(rows=4, classes=6, reduction="mean", device="cpu")),
    EntryPoint("cross_entropy_forward",
               dict(_kinds(logits=ARRAY, targets=ARRAY, reduction=REDUCTION, loss=ARRAY, lse=ARRAY,
                           workspace=ARRAY), **XENT_CONFIG, stream=STREAM), _xent_forward),
    EntryPoint("cross_entropy_backward",
               dict(_kinds(dloss=ARRAY, logits=ARRAY, targets=ARRAY, lse=ARRAY, reduction=REDUCTION,
                           dlogits=ARRAY, workspace=ARRAY), **XENT_CONFIG, stream=STREAM), _xent_backward),
    EntryPoint("cross_entropy_forward_backward",
               dict(_kinds(logits=ARRAY, targets=ARRAY, reduction=REDUCTION, loss=ARRAY, dlogits=ARRAY,
                           lse=ARRAY, workspace=ARRAY), **XENT_CONFIG, stream=STREAM),
               _xent_forward_backward),
    EntryPoint("linear_cross_entropy_workspace_size",
               dict(_kinds(tokens=INT64, vocab=INT64, hidden=INT64, dtype=DTYPE, dweight_dtype=DTYPE,
                           has_bias=BOOL, reduction=REDUCTION, device=DEVICE), **XENT_CONFIG),
               lambda rng: dict(tokens=4, vocab=6, hidden=3, dtype=fusekit.DType.f32,
                                dweight_dtype=fusekit.DType.f32, has_bias=True, reduction="mean", device="cpu",
                                **_xent_config())),
    EntryPoint("linear_cross_entropy",
               dict(_kinds(h=ARRAY, weight=ARRAY, bias=ARRAY, targets=ARRAY, reduction=REDUCTION, loss=ARRAY,
                           dh=ARRAY, dweight=ARRAY, dbias=ARRAY, workspace=ARRAY), **XENT_CONFIG, stream=STREAM),
               _lxent),
    # optimizer
    EntryPoint("global_norm_workspace_size", _kinds(tensors=ARRAYS, device=DEVICE),
               lambda rng: dict(tensors=[f32(rng, 3, 4), f32(rng, 5)], device="cpu")),
    EntryPoint("global_norm", _kinds(tensors=ARRAYS, norm=ARRAY, workspace=ARRAY, stream=STREAM),
               lambda rng: dict(tensors=[f32(rng, 3, 4), f32(rng, 5)], norm=out(1), workspace=None, stream=None)),
    EntryPoint("adamw_step",
               _kinds(params=ARRAYS, grads=ARRAYS, exp_avg=ARRAYS, exp_avg_sq=ARRAYS, param_copies=ARRAYS,
                      grad_norm=ARRAY, lr=FLOAT, beta1=FLOAT, beta2=FLOAT, eps=FLOAT, weight_decay=FLOAT,
                      step=INT64, max_grad_norm=FLOAT, stream=STREAM),
               _adamw),
    # embeddings
    EntryPoint("embedding_backward_workspace_size",
               _kinds(tokens=INT64, vocab=INT64, dim=INT64, device=DEVICE),
               lambda rng: dict(tokens=6, vocab=7, dim=4, device="cpu")),
    EntryPoint("embedding_forward",
               _kinds(tokens=ARRAY, weight=ARRAY, position_weight=ARRAY, out=ARRAY, stream=STREAM),
               _embedding_forward),
    EntryPoint("embedding_backward",
               _kinds(dout=ARRAY, tokens=ARRAY, dweight=ARRAY, dposition_weight=ARRAY, accumulate=BOOL,
                      workspace=ARRAY, stream=STREAM), _embedding_backward),
    # gated activations
    EntryPoint("gated_act_forward",
               _kinds(gate_up=ARRAY, activation=ACTIVATION, y=ARRAY, layout=LAYOUT, stream=STREAM),
               _gated_forward),
    EntryPoint("gated_act_backward",
               _kinds(dy=ARRAY, gate_up=ARRAY, activation=ACTIVATION, dgate_up=ARRAY, layout=LAYOUT,
                      in_place_backward=BOOL, stream=STREAM), _gated_backward),
    EntryPoint("gated_act_forward_separate",
               _kinds(gate=ARRAY, up=ARRAY, activation=ACTIVATION, y=ARRAY, stream=STREAM),
               _gated_forward_separate),
    EntryPoint("gated_act_backward_separate",
               _kinds(dy=ARRAY, gate=ARRAY, up=ARRAY, activation=ACTIVATION, dgate=ARRAY, dup=ARRAY,
                      in_place_backward=BOOL, stream=STREAM), _gated_backward_separate),
    EntryPoint("_gated_act_forward_alloc", _kinds(gate_up=ARRAY, activation=ACTIVATION, layout=LAYOUT),
               lambda rng: dict(gate_up=f32(rng, 2, 8), activation="silu", layout="halves"),
               expect=UNSUPPORTED),
    EntryPoint("_gated_act_backward_alloc",
               _kinds(dy=ARRAY, gate_up=ARRAY, activation=ACTIVATION, layout=LAYOUT),
               lambda rng: dict(dy=f32(rng, 2, 4), gate_up=f32(rng, 2, 8), activation="silu",
                                layout="interleaved"), expect=UNSUPPORTED),
    EntryPoint("_gated_act_forward_separate_alloc", _kinds(gate=ARRAY, up=ARRAY, activation=ACTIVATION),
               lambda rng: dict(_gated_separate(rng), activation="gelu_erf"), expect=UNSUPPORTED),
    EntryPoint("_gated_act_backward_separate_alloc",
               _kinds(dy=ARRAY, gate=ARRAY, up=ARRAY, activation=ACTIVATION, need_dgate=BOOL, need_dup=BOOL),
               lambda rng: dict(dy=f32(rng, 2, 4), **_gated_separate(rng), activation="silu", need_dgate=True,
                                need_dup=False), expect=UNSUPPORTED),
    # rotary embeddings
    EntryPoint("rope_forward",
               dict(_kinds(q=ARRAY, k=ARRAY, position_ids=ARRAY, q_out=ARRAY, k_out=ARRAY), **ROPE_CONFIG,
                    stream=STREAM), _rope_forward),
    EntryPoint("rope_backward",
               dict(_kinds(dq_out=ARRAY, dk_out=ARRAY, position_ids=ARRAY, dq=ARRAY, dk=ARRAY), **ROPE_CONFIG,
                    stream=STREAM), _rope_backward),
]
BY_NAME = {e.name: e for e in ENTRY_POINTS}


# ---- probes per scalar kind ----------------------------------------------------------------------
class Probes:
    """wrong_type: values that must raise ArgumentTypeError; out_of_range: values the C++ type cannot
    hold (InvalidArgumentError); equivalent(valid): (value, plain Python value) pairs that must give
    the same outcome."""

    def __init__(self, wrong_type, out_of_range=(), equivalent=lambda valid: ()):
        self.wrong_type, self.out_of_range, self.equivalent = wrong_type, out_of_range, equivalent


def _float_equivalents(valid):
    if valid is None:
        return [(np.float32(0.5), 0.5), (2, 2.0)]
    return [(np.float32(valid), float(np.float32(valid))), (np.float64(valid), float(valid)),
            (np.float16(valid), float(np.float16(valid))), (np.array(valid), float(valid)), (0, 0.0),
            (np.int64(1), 1.0)]


def _int_equivalents(valid):
    pairs = [(np.int64(valid), valid), (np.array(valid), valid), (np.int8(-1), -1)]
    if -2**31 <= valid < 2**31:
        pairs.append((np.int32(valid), valid))
    if valid >= 0:
        pairs += [(np.uint64(valid), valid), (np.uint8(valid % 256), valid % 256)]
    return pairs


_NUMBER_WRONG_TYPES = [None, "1", True, np.bool_(False), 1 + 0j, np.complex64(1), [1], b"1",
                       np.ones(2), object()]
_INT_WRONG_TYPES = _NUMBER_WRONG_TYPES + [1.0, np.float32(1), np.float64(2)]

PROBES = {
    FLOAT: Probes(_NUMBER_WRONG_TYPES, [1e39, -3.5e38, np.float64(1e300), 2**200, 2**1024, -(10**400)],
                  _float_equivalents),
    OPT_FLOAT: Probes([v for v in _NUMBER_WRONG_TYPES if v is not None], [1e39, 2**1024],
                      _float_equivalents),
    INT64: Probes(_INT_WRONG_TYPES, [2**63, -2**63 - 1, 2**64, np.uint64(2**64 - 1), 2**200],
                  _int_equivalents),
    INT32: Probes(_INT_WRONG_TYPES, [2**31, -2**31 - 1, 2**63, 2**64, np.int64(2**40)],
                  _int_equivalents),
    UINT64: Probes(_INT_WRONG_TYPES, [-1, 2**64, np.int64(-5), 2**200], _int_equivalents),
    BOOL: Probes([None, "True", 1, 0, 1.0, np.int64(1), [True]], (),
                 lambda valid: [(np.bool_(valid), bool(valid))]),
    DTYPE: Probes([None, "f32", 0, True, np.float32, fusekit.Activation.relu]),
    DEVICE: Probes([None, 0, True, b"cpu", fusekit.DType.f32],
                   ["gpu", "cuda:x", "cuda:-1", "cuda:+1", "CPU", "", "cuda: 0"]),
    ACTIVATION: Probes([None, 1, 0.0, True, fusekit.AttentionMask.none, b"relu"], ["gelu", "", "RELU"],
                       lambda valid: [(getattr(fusekit.Activation, valid), valid)]),
    MASK: Probes([None, 0, 0.0, True, fusekit.Activation.none, b"none"], ["causal", ""],
                 lambda valid: [(getattr(fusekit.AttentionMask, valid), valid)]),
    REDUCTION: Probes([None, 0, 1.0, True, fusekit.Activation.none, b"mean"], ["avg", "", "Mean"],
                      lambda valid: [(getattr(fusekit.LossReduction, valid), valid)]),
    LAYOUT: Probes([None, 0, True, fusekit.RopeStyle.interleaved, b"halves"], ["split", "", "Halves"],
                   lambda valid: [(getattr(fusekit.GatedLayout, valid), valid)]),
    STYLE: Probes([None, 1, True, fusekit.GatedLayout.interleaved, b"rotate_half"], ["neox", "", "gptj"],
                  lambda valid: [(getattr(fusekit.RopeStyle, valid), valid)]),
    STREAM: Probes(["s", 1.0, True, [0], b"0"], [-1, 2**64],
                   lambda valid: [(np.uint64(0), 0), (0, None)]),
    CFG: Probes([None, list(_cfg_tuple()), "cfg", 0], [_cfg_tuple()[:8], ()]),
}


# ---- running a call and describing what it did ---------------------------------------------------
def outcome(entry, kwargs):
    """What the call did: ('error', class name, message) or ('ok', its return value, the bytes of
    every array argument afterwards), comparable with ==."""
    try:
        result = entry.function(**kwargs)
    except fusekit.Error as e:
        return ("error", type(e).__name__, str(e))
    if not isinstance(result, (int, str, bool, type(None))):
        result = type(result).__name__
    arrays = tuple((name, a.tobytes()) for name, a in kwargs.items()
                   if entry.kinds[name] == ARRAY and isinstance(a, np.ndarray))
    return ("ok", result, arrays)


def summary(result):
    """An outcome without the array bytes, for failure messages."""
    return result if result[0] == "error" else result[:2] + (tuple(name for name, _ in result[2]),)


def with_value(entry, rng_seed, name, value):
    """A valid call of `entry` (arrays from `rng_seed`) with argument `name` set to `value`."""
    kwargs = entry.make(np.random.default_rng(rng_seed))
    kwargs[name] = value
    return kwargs


def float32_holds(value):
    """Whether fusekit's float32 conversion keeps a number (Python or NumPy) finite where it is:
    finite values from 2^128 - 2^103 up round to infinity."""
    try:
        v = float(value)
    except OverflowError:
        return False
    return not math.isfinite(v) or abs(v) < 2.0**128 - 2.0**103
