#!/usr/bin/env python3
# Host simulation of stats_bulk_kernel's per-warp ring (branch lab/fp8-stats-bulk): the copier's
# incremental sources/slots against the consumer's (row, chunk, slot, parity) sequence, with
# the "full" mbarrier phases modelled (a wait on parity P passes once the phase numbered with
# parity P, i.e. the current or the immediately preceding one, has completed). The warp refills a
# slot only after its own lanes have read it (program order and a __syncwarp since session 37, no
# "empty" barrier): the model asserts that every refill finds its slot consumed.
import itertools, random

def simulate(rows, grid, warp_count, cols, log2_group, sc_size, rounds, stages, x_stride, s_stride):
    nvec = cols // 16
    chunks = nvec // (128 * rounds)
    chunk_x = rounds * 2048
    chunk_s = rounds * ((128 >> (log2_group - 4)) * sc_size)
    slot_bytes = chunk_x + chunk_s
    row_step = grid * warp_count
    x_jump = row_step * x_stride - cols
    s_jump = (row_step * s_stride - (cols >> log2_group)) * sc_size
    for block in range(grid):
        for warp in range(warp_count):
            first = block * warp_count + warp
            # copier
            cp = dict(x=first * x_stride, s=first * s_stride * sc_size, row=first, chunk=0, slot=0)
            full_done = [0] * stages   # completed phases
            slot_content = [None] * stages
            def copy_next():
                if cp['row'] >= rows: return
                s = cp['slot']
                # the slot must be free: its previous content consumed
                assert slot_content[s] is None, ("overwrite", s)
                slot_content[s] = (cp['row'], cp['chunk'], cp['x'], cp['s'])
                full_done[s] += 1  # copy completes (any time before the consumer's wait)
                cp['x'] += chunk_x; cp['s'] += chunk_s
                cp['chunk'] += 1
                if cp['chunk'] == chunks:
                    cp['chunk'] = 0; cp['row'] += row_step; cp['x'] += x_jump; cp['s'] += s_jump
                cp['slot'] = (cp['slot'] + 1) % stages
            def passes(done, parity):
                # current phase number = done; wait(parity) passes iff phase (done-1) has parity, or
                # the "preceding" phase semantics: passes when done % 2 != parity is false...
                return done > 0 and (done - 1) % 2 == parity or (done == 0 and parity == 1)
            for _ in range(stages - 1): copy_next()
            slot = 0; parity = 0
            row = first
            while row < rows:
                for c in range(chunks):
                    copy_next()  # into the slot read last (copy_next asserts it is consumed)
                    assert passes(full_done[slot], parity), ("full wait hangs", slot)
                    got = slot_content[slot]
                    assert got is not None and got[0] == row and got[1] == c, (got, row, c)
                    # sources equal the direct formulas
                    assert got[2] == row * x_stride + c * chunk_x
                    assert got[3] == row * s_stride * sc_size + c * chunk_s
                    slot_content[slot] = None  # the warp's lanes have read it
                    slot += 1
                    if slot == stages: slot = 0; parity ^= 1
                row += row_step
            assert all(v is None for v in slot_content), "copies left in flight at exit"
            assert cp['row'] >= rows

random.seed(1)
n = 0
for cols in (2048, 4096, 6144, 8192, 16384):
    for rounds in (1, 2, 4):
        if (cols // 2048) % rounds: continue
        for stages in range(2, 9):
            for rows in (1, 7, 8, 9, 100, 1000):
                for grid in (1, 3, 13):
                    for lg, sz in ((4, 2), (5, 4), (8, 2), (9, 4)):
                        xs = cols + random.choice((0, 32)); ss = (cols >> lg) + random.choice((0, 16 // sz))
                        simulate(rows, grid, 8, cols, lg, sz, rounds, stages, xs, ss); n += 1
print("ok", n, "configurations")
