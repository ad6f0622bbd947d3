#!/usr/bin/env python3
"""Host simulation of the FP8 backward's deferred row sums (kDeferredSum in fp8_norm_kernels.cuh).

Each warp of a row group runs iterations k = 0 .. iters: for k < iters it posts its share of row
k in slot k % SLOTS and arrives on that slot's mbarrier (count = warps); for k > 0 it waits on the
barrier of row k - 1 with parity ((k - 1) / SLOTS) & 1 and reads every warp's slot. Warps advance
in random interleavings. Checked: every read sees the row it expects from every warp (no slot is
overwritten early), every wait completes on the phase of its own row (never one phase too far,
where the parity would mislead), and no interleaving deadlocks. With SLOTS = 3 the first check
must fail for some interleaving (the simulation proves it can).
"""
import random
import sys


def run(warps, iters, slots, rng):
    phase_done = [0] * slots          # completed phases per barrier
    pending = [warps] * slots         # arrivals still missing in the current phase
    slot = [[None] * warps for _ in range(slots)]
    # Per warp: (k, step) with step 0 = post, 1 = wait+read, 2 = advance.
    state = [[0, 0] for _ in range(warps)]
    done = [False] * warps
    while not all(done):
        runnable = []
        for w in range(warps):
            if done[w]:
                continue
            k, step = state[w]
            if step == 1 and k > 0:
                b = (k - 1) % slots
                parity = ((k - 1) // slots) & 1
                if phase_done[b] % 2 == parity:  # try_wait.parity: the phase of that parity not yet done
                    continue
            runnable.append(w)
        if not runnable:
            return "deadlock"
        w = rng.choice(runnable)
        k, step = state[w]
        if step == 0:
            if k < iters:
                b = k % slots
                slot[b][w] = k
                pending[b] -= 1
                if pending[b] == 0:
                    phase_done[b] += 1
                    pending[b] = warps
            state[w] = [k, 1]
        elif step == 1:
            if k > 0:
                b = (k - 1) % slots
                if phase_done[b] != (k - 1) // slots + 1:
                    return f"wait of row {k - 1} saw {phase_done[b]} phases"
                for v in range(warps):
                    if slot[b][v] != k - 1:
                        return f"warp {w} read row {slot[b][v]} of warp {v} for row {k - 1}"
            state[w] = [k, 2]
        else:
            if k == iters:
                done[w] = True
            else:
                state[w] = [k + 1, 0]
    return None


def main():
    rng = random.Random(2026)
    trials = 0
    for warps in (2, 4, 8):
        for iters in (0, 1, 2, 3, 4, 5, 8, 13, 33):
            for _ in range(300):
                err = run(warps, iters, 4, rng)
                trials += 1
                if err:
                    print(f"FAIL warps={warps} iters={iters}: {err}")
                    return 1
    # Three slots are not enough: some interleaving must overwrite a slot before it is read.
    failures = sum(run(8, 33, 3, rng) is not None for _ in range(2000))
    if failures == 0:
        print("FAIL: three slots never failed; the four-slot argument is not exercised")
        return 1
    print(f"ok: {trials} runs with 4 slots pass; 3 slots fail in {failures} of 2000 runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
