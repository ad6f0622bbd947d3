"""Every scalar argument of every entry point of fusekit._C names itself in its errors, with
PyTorch's argument parser as the bar:

* a value of the wrong Python type (None, a str, a float for an int, a bool for a number, an int for
  a bool, ...) raises fusekit.ArgumentTypeError, a TypeError (and an InvalidArgumentError):
  "fusekit.<op>: argument '<name>' must be <type>, not <type>";
* a value of the right type that the C++ parameter cannot hold (an int past int64 / int32, a
  negative seed, a float past float32's range, an unknown option name) raises InvalidArgumentError
  naming the op and the argument, with expected and got;
* NumPy scalars, and an int where a float goes, behave exactly as the plain Python value.

Arrays NumPy cannot hand over (another byte order, object or string dtypes) get a dtype error naming
the argument, and a workspace-size query for 'cuda' on a machine without a GPU says that no CUDA
device is present. The entry points and their arguments come from the module itself
(fk_entry_points.py): a new one without a row there fails the first test."""
import numpy as np
import pytest

import fusekit
from fk_entry_points import (ARRAY, ARRAYS, BY_NAME, CFG, CFG_ITEMS, DEVICE, DTYPE, ENTRY_POINTS, PROBES,
                             SCALAR_KINDS, module_entry_points, outcome, signature_arguments,
                             summary, with_value)


def _available():
    return [e for e in ENTRY_POINTS if e.available()]


def _arguments(kinds=None):
    """(entry name, argument) for every scalar argument (of `kinds`, where given)."""
    return [(e.name, a) for e in _available() for a in e.scalars()
            if kinds is None or e.kinds[a] in kinds]


_SCALARS = _arguments()
_SCALAR_IDS = [f"{name}-{argument}" for name, argument in _SCALARS]


def each_value(values, check):
    """check(value) for every value; fails listing every value that failed, with why."""
    failures = []
    for value in values:
        try:
            check(value)
        except AssertionError as e:
            failures.append(f"{value!r}: {str(e).splitlines()[0]}")
        except Exception as e:  # noqa: BLE001 - any other exception is a failure of the contract
            failures.append(f"{value!r}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def assert_type_error(call, entry, name, value):
    with pytest.raises(TypeError) as info:
        call()
    e = info.value
    message = str(e)
    assert isinstance(e, fusekit.ArgumentTypeError) and isinstance(e, fusekit.InvalidArgumentError), \
        f"{type(e).__name__}: {message}"
    assert message.startswith(f"fusekit.{entry.op}: argument '{name}' must be "), message
    assert (e.op, e.argument, e.kind) == (entry.op, name, "invalid_argument"), message
    assert message.endswith(f"must be {e.expected}, not {e.got}"), message
    type_name = type(value).__name__
    assert e.got.split(".")[-1] == type_name, (message, type_name)


def assert_value_error(call, entry, name, words=None):
    with pytest.raises(fusekit.InvalidArgumentError) as info:
        call()
    e = info.value
    message = str(e)
    assert not isinstance(e, TypeError), f"a value of the right type raised a TypeError: {message}"
    assert message.startswith(f"fusekit.{entry.op}: argument '{name}': expected "), message
    assert (e.op, e.argument) == (entry.op, name), message
    assert f"expected {e.expected}, got {e.got}" in message, message
    if words:
        assert words in message, message


# ---- coverage ------------------------------------------------------------------------------------
def test_every_entry_point_and_argument_is_covered():
    in_module = module_entry_points()
    assert sorted(BY_NAME) == in_module, (
        f"entry points without a row in fk_entry_points.py: {sorted(set(in_module) - set(BY_NAME))}; "
        f"rows for functions that are gone: {sorted(set(BY_NAME) - set(in_module))}")
    for entry in ENTRY_POINTS:
        arguments = signature_arguments(entry.function)
        assert arguments == list(entry.kinds), f"{entry.name}: arguments {arguments}, rows {list(entry.kinds)}"
        assert all(kind in SCALAR_KINDS or kind in (ARRAY, ARRAYS) for kind in entry.kinds.values())


def test_error_classes():
    assert issubclass(fusekit.ArgumentTypeError, TypeError)
    assert issubclass(fusekit.ArgumentTypeError, fusekit.InvalidArgumentError)
    assert issubclass(fusekit.ArgumentTypeError, fusekit.Error)


@pytest.mark.parametrize("name", [e.name for e in ENTRY_POINTS])
def test_the_valid_call_is_valid(name):
    entry = BY_NAME[name]
    if not entry.available():
        pytest.skip("ml_dtypes is not installed (NumPy has no FP8 types)")
    kind, *rest = outcome(entry, entry.make(np.random.default_rng(0)))
    if entry.expect == "ok":
        assert kind == "ok", rest
    else:
        assert kind == "error" and rest[0] == entry.expect, rest


# ---- scalars -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,argument", _SCALARS, ids=_SCALAR_IDS)
def test_wrong_type_raises_type_error_naming_the_argument(name, argument, seed):
    entry = BY_NAME[name]
    each_value(PROBES[entry.kinds[argument]].wrong_type, lambda value: assert_type_error(
        lambda: entry.function(**with_value(entry, seed, argument, value)), entry, argument, value))


@pytest.mark.parametrize("name,argument", _SCALARS, ids=_SCALAR_IDS)
def test_value_the_type_cannot_hold_raises_invalid_argument(name, argument, seed):
    entry = BY_NAME[name]
    each_value(PROBES[entry.kinds[argument]].out_of_range, lambda value: assert_value_error(
        lambda: entry.function(**with_value(entry, seed, argument, value)), entry, argument))


_HAVE_EQUIVALENTS = _arguments(set(SCALAR_KINDS) - {CFG, DTYPE, DEVICE})


@pytest.mark.parametrize("name,argument", _HAVE_EQUIVALENTS, ids=[f"{n}-{a}" for n, a in _HAVE_EQUIVALENTS])
def test_numpy_scalars_and_ints_behave_as_the_python_value(name, argument, seed):
    entry = BY_NAME[name]
    valid = entry.make(np.random.default_rng(seed))[argument]
    pairs = dict(enumerate(PROBES[entry.kinds[argument]].equivalent(valid)))

    def same(i):
        value, plain = pairs[i]
        got = outcome(entry, with_value(entry, seed, argument, value))
        want = outcome(entry, with_value(entry, seed, argument, plain))
        assert got == want, f"{value!r} gave {summary(got)}, {plain!r} gave {summary(want)}"

    each_value(list(pairs), same)


def test_messages_read_as_pytorchs():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match=r"^fusekit\.layer_norm_forward: argument 'eps' must be float, "
                                        r"not NoneType$"):
        fusekit.layer_norm_forward(x, None, None, None, np.empty_like(x))
    with pytest.raises(TypeError, match=r"argument 'rows' must be int, not float$"):
        fusekit.norm_backward_workspace_size(4.0, 8, fusekit.DType.f32, "cpu")
    with pytest.raises(TypeError, match=r"argument 'dtype' must be fusekit.DType, not bool$"):
        fusekit.norm_backward_workspace_size(4, 8, True, "cpu")
    with pytest.raises(TypeError, match=r"^fusekit\.cross_entropy_workspace_size: argument 'reduction' must be "
                                        r"fusekit\.LossReduction or str, not NoneType$"):
        fusekit.cross_entropy_workspace_size(4, 6, None, "cpu")
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"argument 'style': expected fusekit\.RopeStyle or one of 'rotate_half', "
                             r"'interleaved', got 'neox'$"):
        fusekit.rope_forward(x[None, :, None], None, None, np.empty_like(x[None, :, None]), None, style="neox")
    with pytest.raises(TypeError, match=r"argument 'seed' must be int, not str$"):
        fusekit.dropout_keep_mask("1", 0, 0.5, np.zeros(4, np.uint8))
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"argument 'seed': expected an int in \[0, 2\^64\), got -1$"):
        fusekit.dropout_keep_mask(-1, 0, 0.5, np.zeros(4, np.uint8))
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"argument 'window_left': expected an int in \[-2\^63, 2\^63\), "
                             r"got 9223372036854775808$"):
        a = np.zeros((1, 1, 1, 4), np.float32)
        fusekit.attention_forward(a, a, a, None, a, np.zeros((1, 1, 1), np.float32), window_left=2**63)
    with pytest.raises(fusekit.InvalidArgumentError, match=r"argument 'eps': expected a number float32 "
                                                          r"can hold .*, got 1e\+39$"):
        fusekit.rms_norm_forward(x, None, 1e39, np.empty_like(x))
    with pytest.raises(fusekit.InvalidArgumentError, match=r"argument 'eps': .*got an int of 1025 bits$"):
        fusekit.rms_norm_forward(x, None, 2**1024, np.empty_like(x))


@pytest.mark.parametrize("item", range(len(CFG_ITEMS)), ids=[n for n, _ in CFG_ITEMS])
@pytest.mark.parametrize("name", ["_attention_forward_alloc", "_attention_backward_alloc"])
def test_config_tuple_items_are_named(name, item, seed):
    """fusekit.torch's config tuple: each item converted as attention_forward's keyword argument of
    the same name, and named in the errors."""
    entry = BY_NAME[name]
    argument, kind = CFG_ITEMS[item]
    for value in PROBES[kind].wrong_type:
        kwargs = entry.make(np.random.default_rng(seed))
        cfg = list(kwargs["cfg"])
        cfg[item] = value
        kwargs["cfg"] = tuple(cfg)
        assert_type_error(lambda: entry.function(**kwargs), entry, argument, value)
    for value in PROBES[kind].out_of_range:
        kwargs = entry.make(np.random.default_rng(seed))
        kwargs["cfg"] = kwargs["cfg"][:item] + (value,) + kwargs["cfg"][item + 1:]
        assert_value_error(lambda: entry.function(**kwargs), entry, argument)


# ---- arrays NumPy cannot hand over ---------------------------------------------------------------
def _array_cases():
    cases, ids = [], []
    for entry in _available():
        valid = entry.make(np.random.default_rng(0))
        for name, kind in entry.kinds.items():
            if kind == ARRAY and isinstance(valid.get(name), np.ndarray):
                cases.append((entry.name, name))
                ids.append(f"{entry.name}-{name}")
    return cases, ids


_ARRAYS, _ARRAY_IDS = _array_cases()


@pytest.mark.parametrize("name,argument", _ARRAYS, ids=_ARRAY_IDS)
def test_unsupported_numpy_dtypes_name_the_argument(name, argument, seed):
    entry = BY_NAME[name]
    valid = entry.make(np.random.default_rng(seed))[argument]
    variants = [(valid.astype(object), "got object"), (np.zeros(valid.shape, "U3"), "got <U3"),
                (np.zeros(valid.shape, "datetime64[s]"), "got datetime64[s]")]
    if valid.dtype.kind in "fiu" and valid.dtype.itemsize > 1:
        swapped = valid.astype(valid.dtype.newbyteorder(">" if np.little_endian else "<"))
        variants.append((swapped, "(big-endian)" if np.little_endian else "(little-endian)"))
    for bad, words in variants:
        kwargs = entry.make(np.random.default_rng(seed))
        kwargs[argument] = bad
        assert_value_error(lambda: entry.function(**kwargs), entry, argument, words)


def test_big_endian_array_message():
    x = np.ones((2, 4), ">f4")
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"^fusekit\.rms_norm_forward: argument 'x': expected an array of dtype f32, "
                             r".* in the machine's byte order \(little-endian\), got >f4 \(big-endian\)$"):
        fusekit.rms_norm_forward(x, None, 1e-5, np.ones((2, 4), np.float32))
    with pytest.raises(fusekit.InvalidArgumentError, match=r"argument 'array': .*, got object$"):
        fusekit.tensor_info(np.array([object()]))


# ---- devices -------------------------------------------------------------------------------------
_QUERIES = [e.name for e in ENTRY_POINTS if DEVICE in e.kinds.values()]


@pytest.mark.skipif(fusekit.cuda_device_count() > 0, reason="a CUDA device is present")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
@pytest.mark.parametrize("name", _QUERIES)
def test_cuda_query_without_a_gpu_says_so(name, device):
    """Sizes that depend on the GPU cannot be given without one: the error says that no CUDA device
    is present. Sizes that are pure functions of the problem (attention's) are returned."""
    entry = BY_NAME[name]
    kwargs = entry.make(np.random.default_rng(0))
    kwargs["device"] = device
    if "dtype" in kwargs:
        kwargs["dtype"] = fusekit.DType.bf16  # a dtype every family's kernels take
    try:
        size = entry.function(**kwargs)
    except fusekit.InvalidArgumentError as e:
        message = str(e)
        assert message.startswith(f"fusekit.{entry.op}: argument 'device': expected "), message
        assert "it has none: no GPU or no CUDA driver" in message and "below 0" not in message, message
        assert e.argument == "device"
    else:
        assert isinstance(size, int) and size >= 0


@pytest.mark.skipif(fusekit.cuda_device_count() > 0, reason="a CUDA device is present")
def test_describe_cuda_device_without_a_gpu_says_so():
    with pytest.raises(fusekit.InvalidArgumentError,
                       match=r"argument 'device_index': expected the index of a CUDA device present on "
                             r"this machine \(it has none: no GPU or no CUDA driver\), got 0$"):
        fusekit.describe_cuda_device(0)
    assert fusekit.cuda_device_supported(0) is False
