"""A discrete model of the barrier protocols of the two MLA kernels with Q in registers (ops/mla_decode_qreg.py,
ops/mla_decode_fp8_qreg.py), run over random interleavings of their roles and TMA landings:

    python -m bench.model_qreg_protocol [--steps 16] [--seeds 300]     # no GPU

Each role is its kernel loop's sequence of barrier waits and arrivals, slot reads (from an MMA's issue to its wait)
and writes; a wait on an mbarrier passes as `try_wait.parity` does (the barrier's completed phases and the parity
differ). Reported as failures: a deadlock; a wait that passes on the wrong phase (a phase early, or two late: parity
aliasing); a slot read before its data is there; a slot written while another role still reads it. The model
mirrors the kernels' loops by hand: change it with them.
"""

import argparse
import random


class ProtocolError(Exception):
    pass


class _Bar:
    def __init__(self, count):
        self.count, self.arrived, self.done, self.tx = count, 0, 0, 0      # done: completed phases

    def arrive(self):
        self.arrived += 1
        self.settle()

    def settle(self):
        if self.arrived == self.count and self.tx == 0:
            self.arrived, self.done = 0, self.done + 1


class _World:
    def __init__(self, seed):
        self.rnd = random.Random(seed)
        self.readers = {}              # slot -> roles whose MMAs read it
        self.pending = []              # (raw or kv slot, step) TMA copies in flight
        self.bars = []

    def bar(self, count):
        b = _Bar(count)
        self.bars.append(b)
        return b

    def wait(self, bar, phase):
        while bar.done % 2 == phase % 2:
            yield
        if bar.done != phase + 1:
            raise ProtocolError(f"a wait for phase {phase} passed with {bar.done} phases completed")

    def read(self, res, who, on=True):
        (self.readers.setdefault(res, set()).add if on else self.readers.setdefault(res, set()).discard)(who)

    def write(self, res, who):
        if self.readers.get(res):
            raise ProtocolError(f"{who} writes {res} while {sorted(self.readers[res])} read it")

    def issue(self, full, slots, name, k):
        """A TMA copy of step k into slot k % len(slots) of `slots` on full[slot] (the producer's arrival with it)."""
        s = k % len(slots)
        full[s].tx += 1
        self.pending.append((full, slots, name, s, k))
        full[s].arrive()

    def land(self, full, slots, name, s, k):
        self.write((name, s), f"the TMA of step {k}")
        slots[s] = k
        full[s].tx -= 1
        full[s].settle()

    def run(self, roles):
        """Interleave the roles (generators) and the TMA landings at random."""
        live = dict(roles)
        idle = 0
        while live or self.pending:
            who = self.rnd.choice(list(live) + (["tma"] if self.pending else []))
            if who == "tma":
                self.land(*self.pending.pop(self.rnd.randrange(len(self.pending))))
                idle = 0
                continue
            before = sum(b.done for b in self.bars)
            try:
                next(live[who])
            except StopIteration:
                del live[who]
                idle = 0
            idle = 0 if sum(b.done for b in self.bars) != before else idle + 1
            if idle > 20000:
                raise ProtocolError(f"deadlock: {sorted(live)} wait, no copy in flight")


def bf16_protocol(n, ring=5, defer_ready=True, seed=0):
    """ops.mla_decode_qreg: full (TMA), ready (WG0's P), empty (both P V warpgroups); WG1 reloads."""
    w = _World(seed)
    full, empty, ready = ([w.bar(c) for _ in range(ring)] for c in (1, 2, 1))
    kv, p = [None] * ring, [None] * ring

    def issue(k):
        w.issue(full, kv, "kv", k)

    def wg0():
        for k in range(n):
            s = k % ring
            yield from w.wait(full[s], k // ring)
            if kv[s] != k:
                raise ProtocolError(f"WG0 step {k} reads slot {s} holding step {kv[s]}")
            w.read(("kv", s), "wg0")
            yield
            if defer_ready and k > 0:
                ready[(k - 1) % ring].arrive()
            yield
            w.read(("kv", s), "wg0", on=False)
            w.write(("p", s), "wg0")
            p[s] = k
            yield
            if not defer_ready:
                ready[s].arrive()
        if defer_ready and n > 0:
            ready[(n - 1) % ring].arrive()

    def pv(h):
        if h == 0:
            for k in range(min(n, ring)):
                issue(k)
            yield
        for k in range(n):
            s = k % ring
            yield from w.wait(ready[s], k // ring)
            if p[s] != k or kv[s] != k:
                raise ProtocolError(f"P V {h} step {k} reads P of step {p[s]}, V of step {kv[s]}")
            for res in (("p", s), ("kv", s)):
                w.read(res, f"pv{h}")
            yield
            for res in (("p", s), ("kv", s)):
                w.read(res, f"pv{h}", on=False)
            empty[s].arrive()
            if h == 0 and k + ring < n:
                yield from w.wait(empty[s], k // ring)
                issue(k + ring)
            yield

    roles = {"wg0": wg0(), "pv0": pv(0), "pv1": pv(1)}
    next(roles["pv0"])                 # WG1's first copies go out before the roles start (__syncthreads)
    w.run(roles)


def fp8_protocol(n, raw_ring=5, ring=3, ahead=2, defer_ready=True, seed=0):
    """ops.mla_decode_fp8_qreg: raw_full (TMA), conv_full (both converters), raw_empty (both converters and WG0),
    ready (WG0's P); the converters run `ahead` steps ahead of their P V; WG1 reloads the raw ring."""
    w = _World(seed)
    raw_full, raw_empty = [w.bar(1) for _ in range(raw_ring)], [w.bar(3) for _ in range(raw_ring)]
    conv_full, ready = [w.bar(2) for _ in range(ring)], [w.bar(1) for _ in range(ring)]
    raw, conv, p = [None] * raw_ring, [[None, None] for _ in range(ring)], [None] * ring

    def issue(k):
        w.issue(raw_full, raw, "raw", k)

    def wg0():
        for k in range(n):
            c, r = k % ring, k % raw_ring
            yield from w.wait(conv_full[c], k // ring)
            yield from w.wait(raw_full[r], k // raw_ring)
            if conv[c] != [k, k] or raw[r] != k:
                raise ProtocolError(f"WG0 step {k} reads converted steps {conv[c]}, raw step {raw[r]}")
            reads = (("conv", c, 0), ("conv", c, 1), ("raw", r))
            for res in reads:
                w.read(res, "wg0")
            yield
            if defer_ready and k > 0:
                ready[(k - 1) % ring].arrive()
            yield
            for res in reads:
                w.read(res, "wg0", on=False)
            raw_empty[r].arrive()
            yield
            w.write(("p", c), "wg0")
            p[c] = k
            yield
            if not defer_ready:
                ready[c].arrive()
        if defer_ready and n > 0:
            ready[(n - 1) % ring].arrive()

    def convert(h, j):
        r, c = j % raw_ring, j % ring
        yield from w.wait(raw_full[r], j // raw_ring)
        if raw[r] != j:
            raise ProtocolError(f"converter {h} of step {j} reads raw slot {r} holding step {raw[r]}")
        w.write(("conv", c, h), f"converter {h}")
        conv[c][h] = j
        yield
        raw_empty[r].arrive()
        conv_full[c].arrive()

    def pv(h):
        if h == 0:
            for k in range(min(n, raw_ring)):
                issue(k)
            yield
        for k in range(min(n, ahead)):
            yield from convert(h, k)
        for k in range(n):
            if k + ahead < n:
                yield from convert(h, k + ahead)
            c = k % ring
            yield from w.wait(ready[c], k // ring)
            if p[c] != k or conv[c][h] != k:
                raise ProtocolError(f"P V {h} step {k} reads P of step {p[c]}, V of step {conv[c][h]}")
            for res in (("p", c), ("conv", c, h)):
                w.read(res, f"pv{h}")
            yield
            for res in (("p", c), ("conv", c, h)):
                w.read(res, f"pv{h}", on=False)
            if h == 0 and k + raw_ring < n:
                yield from w.wait(raw_empty[k % raw_ring], k // raw_ring)
                issue(k + raw_ring)
            yield

    roles = {"wg0": wg0(), "pv0": pv(0), "pv1": pv(1)}
    next(roles["pv0"])
    w.run(roles)


def failures(protocol, steps, seeds, **params):
    """[(steps, defer_ready, seed, message)] over 0..steps-1 steps, both defer_ready settings, `seeds` schedules."""
    out = []
    for n in range(steps):
        for defer in (True, False):
            for seed in range(seeds):
                try:
                    protocol(n, defer_ready=defer, seed=seed, **params)
                except ProtocolError as e:
                    out.append((n, defer, seed, str(e)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="sequences of 0 .. steps - 1 steps")
    ap.add_argument("--seeds", type=int, default=300, help="random schedules each")
    args = ap.parse_args(argv)
    from ops.mla_decode_fp8_qreg import AHEAD, RAW_RING, RING
    from ops.mla_decode_qreg import RING as BF16_RING

    for name, protocol, params in (("mla_decode_qreg", bf16_protocol, dict(ring=BF16_RING)),
                                   ("mla_decode_fp8_qreg", fp8_protocol,
                                    dict(raw_ring=RAW_RING, ring=RING, ahead=AHEAD))):
        bad = failures(protocol, args.steps, args.seeds, **params)
        print(f"{name} {params}: {len(bad)} failures in {args.steps * 2 * args.seeds} runs"
              + "".join(f"\n  {n} steps, defer_ready={d}, seed {s}: {m}" for n, d, s, m in bad[:5]))


if __name__ == "__main__":
    main()
