"""fusekit's attention bindings with NumPy arrays (the CPU backend, float64 and float32): the
forward against a naive NumPy softmax attention written here (masks, windows, bias broadcasting,
GQA/MQA, Dv != D, variable lengths, strided layouts), the backward against an analytic NumPy
backward and against finite differences of the forward, the dropout mask against the mapping
documented in include/fusekit/attention.h (Philox in NumPy, from test_numpy_bias_act_dropout.py),
the workspace sizes, and bad arguments raising fusekit exceptions that name the argument."""
import math

import numpy as np
import pytest

import fusekit
from fk_testing import (attention_visibility, check_close, check_invalid_argument, rel_l2,
                        rounding_error, to_f64)
from test_numpy_bias_act_dropout import philox4x32_10

NP = {"f64": np.float64, "f32": np.float32}
DTYPES = list(NP)
_LOW32 = np.uint64(0xFFFFFFFF)


# ---- arrays that satisfy the alignment rule ----------------------------------------------------
def padded(shape, dtype, fill=np.nan):
    """An array of `shape` whose last dim is padded in memory to 16 bytes (the rule for bias and
    dbias rows when Sk is not a multiple of 16 / itemsize)."""
    e = 16 // np.dtype(dtype).itemsize
    last = -(-shape[-1] // e) * e
    return np.full(tuple(shape[:-1]) + (last,), fill, dtype)[..., :shape[-1]]


def outputs(q, v, varlen=False):
    """out (NaN-poisoned) and lse for q (B, Sq, Hq, D) or (Tq, Hq, D)."""
    out = np.full(q.shape[:-1] + (v.shape[-1],), np.nan, q.dtype)
    if varlen:
        lse = np.full((q.shape[1], q.shape[0]), np.nan, np.float32)
    else:
        lse = np.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, np.float32)
    return out, lse


# ---- the documented dropout mask, from Philox in NumPy ----------------------------------------
def documented_keep(seed, offset, p, B, H, Sq, Sk):
    """keep[b, h, i, j]: u16 = half j % 2 of word (j % 8) // 2 of philox(counter = i * 2^29 + j // 8,
    subsequence = (b * H + h) * 2^32 + offset, key = seed), kept iff u16 >= min(ceil(p 65536), 65535)."""
    b, h, i, j = (a.astype(np.uint64) for a in np.meshgrid(
        np.arange(B), np.arange(H), np.arange(Sq), np.arange(Sk), indexing="ij"))
    n = (i << np.uint64(29)) + j // np.uint64(8)
    sub = ((b * np.uint64(H) + h) << np.uint64(32)) + np.uint64(offset)
    words = philox4x32_10((n & _LOW32, n >> np.uint64(32), sub & _LOW32, sub >> np.uint64(32)),
                          (seed & 0xFFFFFFFF, seed >> 32))
    word = np.choose(((j % np.uint64(8)) // np.uint64(2)).astype(np.intp), words)
    u16 = np.where(j % np.uint64(2) == 1, word >> np.uint64(16), word & np.uint64(0xFFFF))
    return u16 >= min(math.ceil(float(np.float32(p)) * 65536.0), 65535)


def dropout_factor(seed, offset, p, B, H, Sq, Sk):
    """Z = keep / (1 - p) (p as the float32 the op receives), or ones when p = 0."""
    if p == 0.0:
        return np.ones((B, H, Sq, Sk))
    mask = np.empty((B, H, Sq, Sk), np.uint8)
    fusekit.attention_dropout_keep_mask(seed, offset, p, mask)
    return mask * float(np.float32(1.0) / (np.float32(1.0) - np.float32(p)))


# ---- naive float64 attention --------------------------------------------------------------------
def naive_sequence(q, k, v, bias, scale, vis, z, dout):
    """One sequence: q (sq, Hq, D), k (sk, Hkv, D), v (sk, Hkv, Dv), bias (Hq, sq, sk) or None,
    z (Hq, sq, sk). Returns out, lse (Hq, sq) and, with dout, dq, dk, dv, dS (Hq, sq, sk)."""
    sq, hq, d = q.shape
    sk, hkv, dv_dim = v.shape
    g = hq // hkv
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    S = scale * np.einsum("ihd,jhd->hij", q, kk)
    if bias is not None:
        S = S + bias
    S = np.where(vis[None], S, -np.inf)
    m = S.max(axis=-1, keepdims=True) if sk else np.full((hq, sq, 1), -np.inf)
    live = np.isfinite(m)
    m0 = np.where(live, m, 0.0)
    e = np.exp(S - m0)
    total = e.sum(axis=-1, keepdims=True)
    total = np.where(total > 0, total, 1.0)
    P = np.where(live, e / total, 0.0)
    lse = np.where(live, m0 + np.log(total), -np.inf)[..., 0]
    out = np.einsum("hij,jhd->ihd", P * z, vv)
    if dout is None:
        return out, lse
    dv_full = np.einsum("hij,ihd->jhd", P * z, dout)
    dP = np.einsum("ihd,jhd->hij", dout, vv) * z
    delta = np.einsum("ihd,ihd->hi", dout, out)[..., None]
    dS = P * (dP - delta)
    dq = scale * np.einsum("hij,jhd->ihd", dS, kk)
    dk_full = scale * np.einsum("hij,ihd->jhd", dS, q)
    dk = dk_full.reshape(sk, hkv, g, d).sum(axis=2)
    dv = dv_full.reshape(sk, hkv, g, dv_dim).sum(axis=2)
    return out, lse, dq, dk, dv, dS


def naive(q, k, v, bias=None, *, scale=None, mask="none", window=(-1, -1), p=0.0, seed=0,
          offset=0, cu_q=None, cu_k=None, dout=None):
    """Float64 attention over the logical values. Returns dict(out, lse[, dq, dk, dv, dbias])."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    bias = None if bias is None else to_f64(bias)
    dout = None if dout is None else to_f64(dout)
    varlen = cu_q is not None
    if varlen:
        seqs = [(cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]) for b in range(len(cu_q) - 1)]
    else:
        seqs = [(b, b + 1, b, b + 1) for b in range(q.shape[0])]
    hq = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(np.float32(scale))
    r = {"out": np.zeros(q.shape[:-1] + (v.shape[-1],)),
         "lse": np.zeros((hq, q.shape[0]) if varlen else (q.shape[0], hq, q.shape[1]))}
    if dout is not None:
        r.update(dq=np.zeros_like(q), dk=np.zeros_like(k), dv=np.zeros_like(v))
        r["dbias"] = None if bias is None else np.zeros(bias.shape)
    max_sq = max([s[1] - s[0] for s in seqs], default=0) if varlen else q.shape[1]
    max_sk = max([s[3] - s[2] for s in seqs], default=0) if varlen else k.shape[1]
    z_all = dropout_factor(seed, offset, p, len(seqs), hq, max_sq, max_sk)
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        if varlen:
            qb, kb, vb = q[q0:q1], k[k0:k1], v[k0:k1]
            db = None if dout is None else dout[q0:q1]
        else:
            qb, kb, vb = q[b], k[b], v[b]
            db = None if dout is None else dout[b]
        sq, sk = qb.shape[0], kb.shape[0]
        bias_b = None
        if bias is not None:
            sl = bias[b if bias.shape[0] > 1 else 0]
            sl = sl[:, :sq if sl.shape[1] > 1 else 1, :sk]
            bias_b = np.broadcast_to(sl, (hq, sq, sk))
        res = naive_sequence(qb, kb, vb, bias_b, scale, attention_visibility(sq, sk, mask, window),
                             z_all[b, :, :sq, :sk], db)
        if varlen:
            r["out"][q0:q1], r["lse"][:, q0:q1] = res[0], res[1]
        else:
            r["out"][b], r["lse"][b] = res[0], res[1]
        if dout is None:
            continue
        if varlen:
            r["dq"][q0:q1], r["dk"][k0:k1], r["dv"][k0:k1] = res[2], res[3], res[4]
        else:
            r["dq"][b], r["dk"][b], r["dv"][b] = res[2], res[3], res[4]
        if bias is not None:
            dS = res[5]
            if bias.shape[1] == 1:
                dS = dS.sum(axis=0, keepdims=True)
            if bias.shape[2] == 1:
                dS = dS.sum(axis=1, keepdims=True)
            target = r["dbias"][b if bias.shape[0] > 1 else 0]
            target[:, :dS.shape[1], :sk] += dS
    return r


# ---- running the op ------------------------------------------------------------------------------
def forward(q, k, v, bias=None, **kw):
    varlen = kw.get("cu_seqlens_q") is not None
    out, lse = outputs(q, v, varlen)
    fusekit.attention_forward(q, k, v, bias, out, lse, **kw)
    return out, lse


def backward(dout, q, k, v, out, lse, bias=None, want_dbias=True, **kw):
    dq, dk, dv = (np.full_like(a, np.nan) for a in (q, k, v))
    dbias = padded(bias.shape, bias.dtype) if bias is not None and want_dbias else None
    fusekit.attention_backward(dout, q, k, v, out, lse, bias, dq, dk, dv, dbias, **kw)
    return dq, dk, dv, dbias


def config_kwargs(c):
    """The op's keyword arguments from a test case."""
    kw = {}
    for name in ("scale", "mask", "dropout_p", "seed", "offset"):
        if name in c:
            kw[name] = c[name]
    if "window" in c:
        kw["window_left"], kw["window_right"] = c["window"]
    return kw


def naive_kwargs(c):
    return {"scale": c.get("scale"), "mask": c.get("mask", "none"), "window": c.get("window", (-1, -1)),
            "p": c.get("dropout_p", 0.0), "seed": c.get("seed", 0), "offset": c.get("offset", 0)}


def make_problem(rng, c, dtype):
    """q, k, v, dout, bias for case c: dict of B, Sq, Sk, Hq, Hkv, D, Dv, bias shape."""
    dt = NP[dtype]
    B, Sq, Sk, Hq, Hkv = c.get("B", 2), c.get("Sq", 5), c.get("Sk", 7), c.get("Hq", 2), c.get("Hkv", 2)
    D, Dv = c.get("D", 8), c.get("Dv", 8)
    q = rng.standard_normal((B, Sq, Hq, D)).astype(dt)
    k = rng.standard_normal((B, Sk, Hkv, D)).astype(dt)
    v = rng.standard_normal((B, Sk, Hkv, Dv)).astype(dt)
    dout = rng.standard_normal((B, Sq, Hq, Dv)).astype(dt)
    bias = None
    if "bias" in c:
        shape = tuple({"B": B, "H": Hq, "Sq": Sq, "Sk": Sk, 1: 1}[s] for s in c["bias"])
        bias = padded(shape, dt)
        bias[...] = rng.standard_normal(shape)
        if c.get("bias_inf"):
            bias[..., 0] = -np.inf  # masks key 0 wherever it applies (a bias may hold -inf)
    return q, k, v, dout, bias


CASES = {
    "plain": {},
    "square": {"Sq": 6, "Sk": 6},
    "causal_top_left": {"mask": "causal_top_left", "Sq": 5, "Sk": 9},
    "causal_bottom_right": {"mask": "causal_bottom_right", "Sq": 5, "Sk": 9},
    "window": {"window": (2, 1), "Sq": 7, "Sk": 7},
    "causal_window_left": {"mask": "causal_top_left", "window": (2, -1), "Sq": 8, "Sk": 8},
    "window_right_only": {"window": (-1, 0), "Sq": 6, "Sk": 4},
    "gqa": {"Hq": 6, "Hkv": 2},
    "mqa_causal": {"Hq": 4, "Hkv": 1, "mask": "causal_bottom_right", "Sq": 6, "Sk": 6},
    "dv_differs": {"D": 8, "Dv": 4, "Hq": 4, "Hkv": 2},
    "scale": {"scale": 0.77},
    "bias_full": {"bias": ("B", "H", "Sq", "Sk")},
    "bias_heads": {"bias": (1, "H", "Sq", "Sk"), "Hq": 4, "Hkv": 2},
    "bias_keys_only": {"bias": ("B", 1, 1, "Sk"), "mask": "causal_top_left"},
    "bias_2d": {"bias": (1, 1, "Sq", "Sk"), "window": (1, 1), "Sq": 6, "Sk": 6},
    "bias_neg_inf": {"bias": ("B", "H", "Sq", "Sk"), "bias_inf": True},
    "dropout": {"dropout_p": 0.3, "seed": 2**63 + 12345, "offset": 77, "Hq": 4, "Hkv": 2,
                "bias": (1, "H", "Sq", "Sk")},
}


# ---- forward and backward against NumPy -----------------------------------------------------------
def check(name, got, ref, dtype, f64_bar):
    if dtype == "f64":
        err = rel_l2(got, ref)
        assert err <= f64_bar, f"{name} (f64): rel_l2 {err:.3e} > {f64_bar:.1e}"
    else:
        check_close(name, got, ref, dtype, rounding_error(ref, NP[dtype]))


def check_lse(lse, ref):
    masked = np.isneginf(ref)
    assert np.all(np.isneginf(lse[masked])), "fully masked rows must have lse = -inf"
    np.testing.assert_allclose(lse[~masked], ref[~masked], rtol=3e-7, atol=3e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_numpy(rng, case, dtype):
    c = CASES[case]
    q, k, v, dout, bias = make_problem(rng, c, dtype)
    out, lse = forward(q, k, v, bias, **config_kwargs(c))
    ref = naive(q, k, v, bias, dout=dout, **naive_kwargs(c))
    # The reference computes in float64 and rounds once; lse is float32 always.
    check("out", out, ref["out"], dtype, 1e-12)
    check_lse(lse, ref["lse"])

    dq, dk, dv, dbias = backward(dout, q, k, v, out, lse, bias, **config_kwargs(c))
    # The backward recomputes P from the float32 lse: relative errors of ~1e-7 in float64 too.
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        check(name, got, ref[name], dtype, 2e-6)
    if bias is not None:
        check("dbias", dbias, ref["dbias"], dtype, 2e-6)
    if c.get("dropout_p"):
        z = dropout_factor(c["seed"], c["offset"], c["dropout_p"], q.shape[0], q.shape[2],
                           q.shape[1], k.shape[1])
        assert (z == 0).any() and (z > 0).any()


def test_fully_masked_rows_give_zeros_and_no_nan(rng):
    """causal_bottom_right with Sq > Sk: the first Sq - Sk queries see no key."""
    q, k, v, dout, _ = make_problem(rng, {"Sq": 6, "Sk": 3}, "f64")
    out, lse = forward(q, k, v, mask="causal_bottom_right")
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 3:]))
    dq, dk, dv, _ = backward(dout, q, k, v, out, lse, mask="causal_bottom_right")
    assert np.all(dq[:, :3] == 0)
    for a in (dq, dk, dv):
        assert np.all(np.isfinite(a))
    ref = naive(q, k, v, mask="causal_bottom_right", dout=dout)
    check("dk", dk, ref["dk"], "f64", 2e-6)


# ---- backward against finite differences of the forward -----------------------------------------
FD_CASES = {
    "causal_gqa": {"mask": "causal_top_left", "Hq": 4, "Hkv": 2, "Sq": 4, "Sk": 4, "D": 4, "Dv": 2},
    "bias_window": {"bias": (1, "H", "Sq", "Sk"), "window": (1, 2), "Sq": 3, "Sk": 5, "D": 2, "Dv": 4},
    "dropout_bias_keys": {"bias": ("B", 1, 1, "Sk"), "dropout_p": 0.25, "seed": 99, "offset": 3,
                          "Sq": 4, "Sk": 6, "D": 4, "Dv": 2},
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_backward_matches_finite_differences(rng, case):
    """L = sum(out * dout); central differences of fusekit's own float64 forward."""
    c = dict(FD_CASES[case], B=1, Hq=FD_CASES[case].get("Hq", 2), Hkv=FD_CASES[case].get("Hkv", 1))
    q, k, v, dout, bias = make_problem(rng, c, "f64")
    kw = config_kwargs(c)
    out, lse = forward(q, k, v, bias, **kw)
    grads = dict(zip(("q", "k", "v", "bias"), backward(dout, q, k, v, out, lse, bias, **kw)))
    inputs = {"q": q, "k": k, "v": v, "bias": bias}
    h = 1e-6

    def loss():
        o, _ = forward(q, k, v, bias, **kw)
        return float((o * dout).sum())

    for name, a in inputs.items():
        if a is None:
            continue
        fd = np.zeros(a.shape)
        for idx in np.ndindex(a.shape):
            keep = a[idx]
            a[idx] = keep + h
            plus = loss()
            a[idx] = keep - h
            minus = loss()
            a[idx] = keep
            fd[idx] = (plus - minus) / (2 * h)
        # P is recomputed from the float32 lse: ~1e-7 relative on top of the differences' error.
        err = rel_l2(grads[name], fd)
        assert err < 1e-5, f"d{name}: rel_l2 {err:.2e} against finite differences"


# ---- variable lengths -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal_top_left", "causal_bottom_right"])
def test_varlen_matches_numpy_and_separate_sequences(rng, dtype, mask):
    dt = NP[dtype]
    lens_q, lens_k = [3, 0, 5, 2], [4, 2, 5, 0]  # an empty query and an empty key sequence
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    Hq, Hkv, D, Dv = 4, 2, 8, 4
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(dt)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dt)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv)).astype(dt)
    dout = rng.standard_normal((cu_q[-1], Hq, Dv)).astype(dt)
    # Padded bias: (B, 1, max_q + 1, max_k + 2), sequence b reads bias[b, :, i, j] locally.
    bias = padded((len(lens_q), 1, max(lens_q) + 1, max(lens_k) + 2), dt)
    bias[...] = rng.standard_normal(bias.shape)
    kw = dict(mask=mask, window_left=3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    out, lse = forward(q, k, v, bias, **kw)
    ref = naive(q, k, v, bias, mask=mask, window=(3, -1), cu_q=cu_q, cu_k=cu_k, dout=dout)
    check("out", out, ref["out"], dtype, 1e-12)
    check_lse(lse, ref["lse"])
    dq, dk, dv, dbias = backward(dout, q, k, v, out, lse, bias, **kw)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        check(name, got, ref[name], dtype, 2e-6)
    # Padding no (b, i, j) maps to is written as 0.
    assert np.all(dbias[:, :, max(lens_q):] == 0) and np.all(dbias[:, :, :, max(lens_k):] == 0)

    # Each sequence alone, with fixed lengths, gives the same outputs.
    for b in range(len(lens_q)):
        if lens_q[b] == 0 or lens_k[b] == 0:
            continue
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        bias_b = padded((1, 1, lens_q[b], lens_k[b]), dt)
        bias_b[...] = bias[b:b + 1, :, :lens_q[b], :lens_k[b]]
        o1, l1 = forward(q[None, sl_q], k[None, sl_k], v[None, sl_k], bias_b, mask=mask, window_left=3)
        np.testing.assert_allclose(to_f64(o1[0]), to_f64(out[sl_q]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(l1[0], lse[:, sl_q], rtol=1e-6)


# ---- layouts --------------------------------------------------------------------------------------
def test_bhsd_and_packed_qkv_layouts_need_no_copies(rng):
    """(B, H, S, D) memory seen as (B, S, H, D) views, q/k/v slices of one packed array, out
    written into a strided view: the same results as contiguous arrays, padding untouched."""
    B, S, H, D = 2, 6, 4, 8
    qkv = rng.standard_normal((B, S, 3, H, D))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    bhsd_q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    q_view = bhsd_q.transpose(0, 2, 1, 3)
    assert not q_view.flags.c_contiguous and not q.flags.c_contiguous
    wide = np.full((B, S, H, D + 8), np.nan)
    out = wide[..., :D]
    lse = np.full((B, H, S), np.nan, np.float32)
    fusekit.attention_forward(q_view, k, v, None, out, lse, mask="causal_top_left")
    assert np.all(np.isnan(wide[..., D:])), "padding between rows was written"
    out_c, lse_c = forward(*(np.ascontiguousarray(a) for a in (q, k, v)), mask="causal_top_left")
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)

    dout = rng.standard_normal((B, H, S, D)).transpose(0, 2, 1, 3)
    dqkv = np.full_like(qkv, np.nan)
    fusekit.attention_backward(dout, q_view, k, v, out, lse, None, dqkv[:, :, 0], dqkv[:, :, 1],
                               dqkv[:, :, 2], mask="causal_top_left")
    ref = naive(q, k, v, mask="causal_top_left", dout=dout)
    for i, name in enumerate(("dq", "dk", "dv")):
        check(name, dqkv[:, :, i], ref[name], "f64", 2e-6)


def test_expanded_bias_and_dbias_reduction(rng):
    """A bias expanded with stride 0 over the batch (read-only view) is read as given; its dbias
    is 1 over that dim and holds the sum; a materialized dbias gets each batch's own gradient."""
    q, k, v, dout, _ = make_problem(rng, {"B": 3, "Hq": 2, "Sq": 4, "Sk": 8}, "f64")
    base = rng.standard_normal((1, 2, 4, 8))
    expanded = np.broadcast_to(base, (3, 2, 4, 8))
    out, lse = forward(q, k, v, expanded)
    ref = naive(q, k, v, expanded, dout=dout)
    check("out", out, ref["out"], "f64", 1e-12)
    summed = np.full((1, 2, 4, 8), np.nan)
    fusekit.attention_backward(dout, q, k, v, out, lse, expanded, dbias=summed)
    full = np.full((3, 2, 4, 8), np.nan)
    fusekit.attention_backward(dout, q, k, v, out, lse, expanded, dbias=full)
    check("dbias (full)", full, ref["dbias"], "f64", 2e-6)
    check("dbias (summed)", summed, ref["dbias"].sum(axis=0, keepdims=True), "f64", 2e-6)


def test_backward_subsets_and_determinism(rng):
    c = {"bias": (1, "H", "Sq", "Sk"), "Hq": 4, "Hkv": 2, "mask": "causal_bottom_right",
         "dropout_p": 0.2, "seed": 5, "offset": 1}
    q, k, v, dout, bias = make_problem(rng, c, "f32")
    kw = config_kwargs(c)
    out, lse = forward(q, k, v, bias, **kw)
    full = backward(dout, q, k, v, out, lse, bias, **kw)
    again = backward(dout, q, k, v, out, lse, bias, deterministic=True, **kw)
    for a, b in zip(full, again):
        np.testing.assert_array_equal(a, b)  # the CPU reference is deterministic either way
    only_dk = np.full_like(k, np.nan)
    fusekit.attention_backward(dout, q, k, v, out, lse, bias, dk=only_dk, **kw)
    np.testing.assert_array_equal(only_dk, full[1])
    only_dbias = padded(bias.shape, bias.dtype)
    fusekit.attention_backward(dout, q, k, v, out, lse, bias, dbias=only_dbias, **kw)
    np.testing.assert_array_equal(only_dbias, full[3])
    fusekit.attention_backward(dout, q, k, v, out, lse, bias, **kw)  # nothing asked: a no-op


def test_mask_enum_and_float32_bias_with_float64_inputs(rng):
    q, k, v, dout, _ = make_problem(rng, {}, "f64")
    bias = padded((1, 1, 5, 7), np.float32)
    bias[...] = rng.standard_normal(bias.shape)
    a, _ = forward(q, k, v, bias, mask=fusekit.AttentionMask.causal_bottom_right)
    b, _ = forward(q, k, v, bias, mask="causal_bottom_right")
    np.testing.assert_array_equal(a, b)
    check("out", a, naive(q, k, v, bias, mask="causal_bottom_right")["out"], "f64", 1e-12)
    assert fusekit.ATTENTION_MAX_HEAD_DIM == 256


# ---- dropout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_mask_helper_matches_documented_mapping(rng, p):
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    offset = int(rng.integers(0, 2**32))
    mask = np.full((2, 3, 5, 19), 7, np.uint8)  # 19 keys: groups of eight straddle nothing
    fusekit.attention_dropout_keep_mask(np.uint64(seed), offset, p, mask)
    np.testing.assert_array_equal(mask, documented_keep(seed, offset, p, 2, 3, 5, 19))
    if p == 0.0:
        assert mask.all()


def test_dropout_mask_depends_on_position_not_on_shape(rng):
    """Element (b, h, i, j) is kept or not whatever Sq, Sk and B are (one stream per (b, h) of
    rows of 2^32 keys), so a sub-problem's mask is a corner of a larger one's; Hq does matter."""
    big = np.empty((3, 4, 9, 40), np.uint8)
    fusekit.attention_dropout_keep_mask(11, 2, 0.5, big)
    small = np.empty((2, 4, 5, 17), np.uint8)
    fusekit.attention_dropout_keep_mask(11, 2, 0.5, small)
    np.testing.assert_array_equal(small, big[:2, :, :5, :17])
    kept = big.mean()
    assert 0.45 < kept < 0.55, kept
    other = np.empty((3, 4, 9, 40), np.uint8)
    fusekit.attention_dropout_keep_mask(11, 3, 0.5, other)
    assert 0.4 < (other == big).mean() < 0.6, "offsets must give independent masks"


def test_forward_with_dropout_zeroes_the_documented_elements(rng):
    """With v = identity-like one-hot rows, out[i, h, j] is P[i, j] * Z[i, j]: dropped elements
    are exactly 0 and kept ones P / (1 - p)."""
    B, S, H, seed, offset, p = 1, 8, 2, 424242, 9, 0.5
    q = rng.standard_normal((B, S, H, 8))
    k = rng.standard_normal((B, S, H, 8))
    v = np.zeros((B, S, H, 8))
    for j in range(S):
        v[0, j, :, j] = 1.0
    out, _ = forward(q, k, v, dropout_p=p, seed=seed, offset=offset)
    P = naive(q, k, v)["out"]  # the softmax itself (no dropout)
    keep = documented_keep(seed, offset, p, B, H, S, S)[0]  # (H, i, j)
    for h in range(H):
        got, probs = out[0, :, h, :], P[0, :, h, :]
        np.testing.assert_array_equal(got[~keep[h]], 0.0)
        np.testing.assert_allclose(got[keep[h]], probs[keep[h]] / (1 - p), rtol=1e-12)


# ---- workspace sizes --------------------------------------------------------------------------------
def test_workspace_sizes():
    f = fusekit
    args = (2, 128, 256, 8, 2, 64, 64)
    assert f.attention_forward_workspace_size(*args, f.DType.f32, "cpu") == 0
    assert f.attention_backward_workspace_size(*args, f.DType.f64, "cpu", deterministic=True) == 0
    # The GPU sizes are pure functions of the shape (no CUDA call): documented in attention.h.
    assert f.attention_forward_workspace_size(*args, f.DType.bf16, "cuda") == 0

    def r256(n):
        return -(-n // 256) * 256

    delta = r256(4 * 2 * 128 * 8)
    assert f.attention_backward_workspace_size(*args, f.DType.bf16, "cuda:0", deterministic=True) == delta
    assert f.attention_backward_workspace_size(*args, f.DType.f16, "cuda") == delta + r256(4 * 2 * 128 * 8 * 64)
    with pytest.raises(fusekit.UnsupportedError, match="f32"):
        f.attention_backward_workspace_size(*args, f.DType.f32, "cuda")


# ---- bad arguments ----------------------------------------------------------------------------------
def _a(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def _fwd(q=None, k=None, v=None, bias=None, out=None, lse=None, **kw):
    """A valid f32 forward (B=2, Sq=3, Sk=5, Hq=4, Hkv=2, D=8), with any argument replaced."""
    q = _a(2, 3, 4, 8) if q is None else q
    k = _a(2, 5, 2, 8) if k is None else k
    v = _a(2, 5, 2, 8) if v is None else v
    out = _a(2, 3, 4, 8) if out is None else out
    lse = _a(2, 4, 3) if lse is None else lse
    fusekit.attention_forward(q, k, v, bias, out, lse, **kw)


def _bwd(**replace):
    args = dict(dout=_a(2, 3, 4, 8), q=_a(2, 3, 4, 8), k=_a(2, 5, 2, 8), v=_a(2, 5, 2, 8),
                out=_a(2, 3, 4, 8), lse=_a(2, 4, 3), bias=None, dq=_a(2, 3, 4, 8))
    args.update(replace)
    fusekit.attention_backward(**args)


CU = np.array([0, 3], np.int32)
BAD_CALLS = [
    # (id, call, argument named in the message, words the message must contain)
    ("q_none", lambda: fusekit.attention_forward(None, _a(2, 5, 2, 8), _a(2, 5, 2, 8), None, _a(2, 3, 4, 8), _a(2, 4, 3)), "q", "got None"),
    ("q_3d", lambda: _fwd(q=_a(3, 4, 8)), "q", "4 dimensions"),
    ("q_int", lambda: _fwd(q=_a(2, 3, 4, 8, dtype=np.int32)), "q", "i32"),
    ("k_dtype", lambda: _fwd(k=_a(2, 5, 2, 8, dtype=np.float64)), "k", "f64"),
    ("k_batch", lambda: _fwd(k=_a(3, 5, 2, 8), v=_a(3, 5, 2, 8)), "k", "batch 2"),
    ("k_head_dim", lambda: _fwd(k=_a(2, 5, 2, 12)), "k", "head dim 8"),
    ("hq_not_multiple_of_hkv", lambda: _fwd(k=_a(2, 5, 3, 8), v=_a(2, 5, 3, 8)), "k", "divides"),
    ("v_seq", lambda: _fwd(v=_a(2, 6, 2, 8)), "v", None),
    ("head_dim_alignment", lambda: _fwd(q=_a(2, 3, 4, 6), k=_a(2, 5, 2, 6), v=_a(2, 5, 2, 8)), "q", "multiple of 4"),
    ("head_dim_too_large", lambda: _fwd(q=_a(2, 3, 4, 260), k=_a(2, 5, 2, 260)), "q", "1..256"),
    ("q_strided_head_dim", lambda: _fwd(q=_a(2, 3, 4, 16)[..., ::2]), "q", "stride 1"),
    ("out_shape", lambda: _fwd(out=_a(2, 3, 4, 16)), "out", "(2, 3, 4, 8)"),
    ("out_read_only", lambda: _fwd(out=np.broadcast_to(_a(8), (2, 3, 4, 8))), "out", "read-only"),
    ("lse_dtype", lambda: _fwd(lse=_a(2, 4, 3, dtype=np.float64)), "lse", "float32"),
    ("lse_shape", lambda: _fwd(lse=_a(2, 3, 4)), "lse", "(2, 4, 3)"),
    ("bias_3d", lambda: _fwd(bias=_a(4, 3, 5)), "bias", "4 dimensions"),
    ("bias_heads", lambda: _fwd(bias=padded((1, 2, 3, 5), np.float32, 0)), "bias", "heads"),
    ("bias_keys", lambda: _fwd(bias=_a(1, 1, 3, 8)), "bias", "key dim"),
    ("bias_row_alignment", lambda: _fwd(bias=_a(1, 1, 3, 5)), "bias", "multiples of 4"),
    ("dropout_p_one", lambda: _fwd(dropout_p=1.0), "dropout_p", "[0, 1)"),
    ("dropout_p_negative", lambda: _fwd(dropout_p=-0.1), "dropout_p", "[0, 1)"),
    ("offset_too_large", lambda: _fwd(dropout_p=0.1, offset=2**32), "offset", "2^32"),
    ("seed_negative", lambda: _fwd(seed=-1), "seed", "-1"),
    ("seed_float", lambda: _fwd(seed=1.5), "seed", "float"),
    ("scale_str", lambda: _fwd(scale="big"), "scale", "str"),
    ("scale_inf", lambda: _fwd(scale=float("inf")), "scale", "finite"),
    ("mask_name", lambda: _fwd(mask="causal"), "mask", "'causal'"),
    ("mask_type", lambda: _fwd(mask=1), "mask", "int"),
    ("window_left", lambda: _fwd(window_left=-2), "window_left", "-2"),
    ("window_right", lambda: _fwd(window_right=-5), "window_right", "-5"),
    ("cu_seqlens_k_missing", lambda: _fwd(cu_seqlens_q=CU), "cu_seqlens_k", "None"),
    ("max_seqlen_without_varlen", lambda: _fwd(max_seqlen_q=3), "max_seqlen_q", "0"),
    ("varlen_q_4d", lambda: _fwd(cu_seqlens_q=CU, cu_seqlens_k=np.array([0, 5], np.int32),
                                 max_seqlen_q=3, max_seqlen_k=5), "q", "3 dimensions"),
    ("cu_seqlens_dtype", lambda: _fwd(q=_a(3, 4, 8), k=_a(5, 2, 8), v=_a(5, 2, 8), out=_a(3, 4, 8),
                                      lse=_a(4, 3), cu_seqlens_q=CU.astype(np.int64),
                                      cu_seqlens_k=np.array([0, 5], np.int32), max_seqlen_q=3,
                                      max_seqlen_k=5), "cu_seqlens_q", "int32"),
    ("cu_seqlens_last", lambda: _fwd(q=_a(3, 4, 8), k=_a(5, 2, 8), v=_a(5, 2, 8), out=_a(3, 4, 8),
                                     lse=_a(4, 3), cu_seqlens_q=CU, cu_seqlens_k=np.array([0, 4], np.int32),
                                     max_seqlen_q=3, max_seqlen_k=5), "cu_seqlens_k", "5"),
    ("cu_seqlens_max", lambda: _fwd(q=_a(3, 4, 8), k=_a(5, 2, 8), v=_a(5, 2, 8), out=_a(3, 4, 8),
                                    lse=_a(4, 3), cu_seqlens_q=CU, cu_seqlens_k=np.array([0, 5], np.int32),
                                    max_seqlen_q=2, max_seqlen_k=5), "cu_seqlens_q", "max_seqlen_q"),
    ("stream_str", lambda: _fwd(stream="s"), "stream", "not str"),
    ("dout_shape", lambda: _bwd(dout=_a(2, 3, 4, 4)), "dout", None),
    ("dq_dtype", lambda: _bwd(dq=_a(2, 3, 4, 8, dtype=np.float64)), "dq", "f64"),
    ("dk_shape", lambda: _bwd(dk=_a(2, 5, 4, 8)), "dk", "(2, 5, 2, 8)"),
    ("dbias_without_bias", lambda: _bwd(dbias=_a(1, 1, 3, 8)), "dbias", "without a bias"),
    ("dbias_shape", lambda: _bwd(bias=_a(1, 4, 3, 8)[..., :5], dbias=_a(1, 1, 3, 8)[..., :5]), "dbias", None),
    ("bwd_dropout_p", lambda: _bwd(dropout_p=2.0), "dropout_p", None),
    ("workspace_device", lambda: fusekit.attention_backward_workspace_size(1, 2, 2, 1, 1, 8, 8, fusekit.DType.f16, "gpu"), "device", "'gpu'"),
    ("workspace_negative", lambda: fusekit.attention_forward_workspace_size(1, -2, 2, 1, 1, 8, 8, fusekit.DType.f16, "cpu"), "shape", "-2"),
    ("mask_helper_p", lambda: fusekit.attention_dropout_keep_mask(1, 0, 1.5, _a(1, 1, 2, 2, dtype=np.uint8)), "p", "[0, 1)"),
    ("mask_helper_array", lambda: fusekit.attention_dropout_keep_mask(1, 0, 0.5, _a(4, 4, dtype=np.uint8)), "mask", "4-D"),
]


@pytest.mark.parametrize("call,argument,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_raise_invalid_argument(call, argument, words):
    check_invalid_argument(call, argument, words)


GARBAGE = [None, 1, 2.5, "x", [1, 2], object(), np.float32(1.0), np.array(["a", "b"]),
           np.zeros((0, 4), np.float32), np.ones((2, 3), np.float32)[:, None], np.ones((2, 3, 4, 8))]


@pytest.mark.parametrize("value", GARBAGE, ids=[type(g).__name__ + str(i) for i, g in enumerate(GARBAGE)])
@pytest.mark.parametrize("position", range(7))
def test_garbage_never_crashes(value, position):
    """Any object in any array slot of the backward: a fusekit error or a TypeError, never a crash."""
    args = [_a(2, 3, 4, 8), _a(2, 3, 4, 8), _a(2, 5, 2, 8), _a(2, 5, 2, 8), _a(2, 3, 4, 8),
            _a(2, 4, 3), _a(1, 4, 3, 8)[..., :5]]
    args[position] = value
    try:
        fusekit.attention_backward(*args[:6], args[6], dq=_a(2, 3, 4, 8), dbias=_a(1, 4, 3, 8)[..., :5])
    except (fusekit.Error, TypeError):
        pass
