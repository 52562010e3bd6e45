"""Token ledger: the exact integer counters of SPEC "Token counters", per domain and in total.

Owns processed / exposure / useful / unique / lost / pool per domain, one saturating uint8
exposure counter per sample (the repetition histogram: 0, 1, ..., 255 meaning 255 or more),
its checkpointable state, and the check of SPEC invariants 1-5. It must never decide what is
sampled (runner.data.sampler does), never estimate (every number is an exact integer count of
input/target positions) and never write files itself (callers save `state_dict()`).

Totals are kept as their own counters rather than summed on demand, so invariant 2 is a real
cross-check (a corrupted or hand-edited checkpoint shows up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np

from runner.data.sampler import exact_ratios

_COUNTERS = ("processed", "exposure", "useful", "unique")
_SATURATE = 255


class TokenLedger:
    """Counters for the domains of `samples` (domain id = index in sorted names)."""

    def __init__(self, samples: Mapping[str, int], seq_len: int):
        self.domains = sorted(samples)
        self.samples = np.array([int(samples[d]) for d in self.domains], dtype=np.int64)
        self.seq_len = int(seq_len)
        k = len(self.domains)
        self._by_domain = {c: [0] * k for c in _COUNTERS}
        self._total = {c: 0 for c in _COUNTERS}
        self.committed_steps = 0
        self.seen = [np.zeros(int(n), dtype=np.uint8) for n in self.samples]

    # --- updates ---------------------------------------------------------------------------

    def catch_up_processed(self, spent: Mapping[str, int]) -> None:
        """Raise the processed counters to `spent` per domain: work done after the checkpoint this
        ledger was loaded from, then lost, still counts as processed (SPEC)."""
        current = self.counters()
        catch_up = {d: max(int(spent[d]) - int(current[d]["processed"]), 0) for d in self.domains}
        if any(catch_up.values()):
            self.record_processed(catch_up)

    def record_processed(self, domain_positions: Mapping[str, int]) -> None:
        """Input positions that went through forward+backward (lost work included)."""
        for name, positions in domain_positions.items():
            d = self.domains.index(name)
            positions = int(positions)
            if positions < 0:
                raise ValueError(f"negative processed positions for {name!r}: {positions}")
            self._by_domain["processed"][d] += positions
            self._total["processed"] += positions

    def commit(self, pairs: Sequence[tuple[int, int]] | np.ndarray, useful_by_domain: Mapping[str, int]) -> None:
        """One committed step: its global batch of (domain_id, sample_idx) pairs."""
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        domain_ids, sample_idx = pairs[:, 0], pairs[:, 1]
        for d in np.unique(domain_ids).tolist():
            idx, repeats = np.unique(sample_idx[domain_ids == d], return_counts=True)
            seen = self.seen[d]
            before = seen[idx]
            seen[idx] = np.minimum(before.astype(np.int64) + repeats, _SATURATE).astype(np.uint8)
            exposure = int(repeats.sum()) * self.seq_len
            unique = int(np.count_nonzero(before == 0)) * self.seq_len
            self._by_domain["exposure"][d] += exposure
            self._by_domain["unique"][d] += unique
            self._total["exposure"] += exposure
            self._total["unique"] += unique
        for name, useful in useful_by_domain.items():
            d = self.domains.index(name)
            self._by_domain["useful"][d] += int(useful)
            self._total["useful"] += int(useful)
        self.committed_steps += 1

    # --- reads -----------------------------------------------------------------------------

    def counters(self) -> dict[str, dict[str, int]]:
        """{domain: {pool, processed, exposure, useful, unique, lost}} plus "total"."""
        out = {}
        for d, name in enumerate(self.domains):
            row = {"pool": int(self.samples[d]) * self.seq_len}
            row.update({c: self._by_domain[c][d] for c in _COUNTERS})
            row["lost"] = row["processed"] - row["exposure"]
            out[name] = row
        total = {"pool": int(self.samples.sum()) * self.seq_len, **self._total}
        total["lost"] = total["processed"] - total["exposure"]
        out["total"] = total
        return out

    def histogram(self) -> dict[str, dict[int, int]]:
        """{domain: {times_seen: n_samples}} for times 0..max seen (255 means 255 or more)."""
        out = {}
        for name, seen in zip(self.domains, self.seen):
            counts = np.bincount(seen, minlength=1)
            out[name] = {t: int(n) for t, n in enumerate(counts.tolist())}
        return out

    def realized_ratios(self) -> dict[str, float]:
        total = self._total["exposure"]
        return {name: (self._by_domain["exposure"][d] / total if total else 0.0) for d, name in enumerate(self.domains)}

    def epochs(self) -> dict[str, float]:
        return {
            name: self._by_domain["exposure"][d] / (int(self.samples[d]) * self.seq_len)
            for d, name in enumerate(self.domains)
        }

    def check_invariants(
        self,
        global_batch: int,
        seq_len: int,
        committed_steps: int,
        ratios: Mapping[str, float],
        caps: Mapping[str, float],
    ) -> list[str]:
        """Violations of SPEC invariants 1-5, one readable line each; [] when all hold.

        Invariant 5 compares against the ratios normalised to sum exactly 1 (as the sampler
        uses them), in exact rational arithmetic, so float rounding never decides it.
        """
        problems = []
        rows = self.counters()
        if int(seq_len) != self.seq_len:
            problems.append(f"ledger counts windows of {self.seq_len} tokens, run uses {seq_len}")
        for name, row in rows.items():
            if not row["unique"] <= row["exposure"] <= row["processed"]:
                problems.append(
                    f"invariant 1: {name}: unique {row['unique']:,} <= exposure "
                    f"{row['exposure']:,} <= processed {row['processed']:,} fails"
                )
            if row["useful"] > row["exposure"]:
                problems.append(f"invariant 1: {name}: useful {row['useful']:,} > exposure {row['exposure']:,}")
            if row["unique"] > row["pool"]:
                problems.append(f"invariant 1: {name}: unique {row['unique']:,} > pool {row['pool']:,}")
        for c in _COUNTERS:
            summed = sum(self._by_domain[c])
            if summed != self._total[c]:
                problems.append(f"invariant 2: total {c} {self._total[c]:,} != sum of domains {summed:,}")
        expected = int(committed_steps) * int(global_batch) * int(seq_len)
        if rows["total"]["exposure"] != expected:
            problems.append(
                f"invariant 3: total exposure {rows['total']['exposure']:,} != "
                f"{committed_steps} steps x {global_batch} x {seq_len} = {expected:,}"
            )
        if self.committed_steps != int(committed_steps):
            problems.append(
                f"invariant 3: ledger committed {self.committed_steps} steps, run reports {committed_steps}"
            )
        for name in self.domains:
            row = rows[name]
            cap = Fraction(repr(float(caps[name])))
            if row["exposure"] > cap * row["pool"]:
                problems.append(
                    f"invariant 4: {name}: {row['exposure'] / row['pool']:.6g} epochs "
                    f"> max_repetition_ratio {float(caps[name]):g}"
                )
        exact = exact_ratios(ratios)
        total_exposure = rows["total"]["exposure"]
        for name in self.domains:
            deviation = abs(rows[name]["exposure"] - exact[name] * total_exposure)
            if deviation > self.seq_len:
                problems.append(
                    f"invariant 5: {name}: exposure {rows[name]['exposure']:,} is "
                    f"{float(deviation):,.1f} tokens from ratio {float(ratios[name]):g}"
                    f" x {total_exposure:,} (bound {self.seq_len})"
                )
        return problems

    # --- checkpoint state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Numpy arrays only (safetensors-compatible); scalars are 1-element int64 arrays."""
        state = {
            "samples": self.samples.copy(),
            "seq_len": np.array([self.seq_len], dtype=np.int64),
            "committed_steps": np.array([self.committed_steps], dtype=np.int64),
        }
        for c in _COUNTERS:
            state[f"{c}.by_domain"] = np.array(self._by_domain[c], dtype=np.int64)
            state[f"{c}.total"] = np.array([self._total[c]], dtype=np.int64)
        for name, seen in zip(self.domains, self.seen):
            state[f"seen.{name}"] = seen.copy()
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restores exactly; refuses state for other domains, sample counts or seq_len."""
        names = sorted(k[len("seen.") :] for k in state if k.startswith("seen."))
        if names != self.domains:
            raise ValueError(f"ledger state is for domains {names}, not {self.domains}")
        if not np.array_equal(np.asarray(state["samples"]), self.samples):
            raise ValueError(
                f"ledger state has samples {np.asarray(state['samples']).tolist()}, pools have {self.samples.tolist()}"
            )
        if int(np.asarray(state["seq_len"])[0]) != self.seq_len:
            raise ValueError(f"ledger state is for seq_len {int(state['seq_len'][0])}, not {self.seq_len}")
        self.committed_steps = int(np.asarray(state["committed_steps"])[0])
        for c in _COUNTERS:
            self._by_domain[c] = [int(v) for v in np.asarray(state[f"{c}.by_domain"]).tolist()]
            self._total[c] = int(np.asarray(state[f"{c}.total"])[0])
        self.seen = [np.array(state[f"seen.{name}"], dtype=np.uint8, copy=True) for name in self.domains]
