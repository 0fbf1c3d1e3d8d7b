"""A hypothesis state machine of PrefixCache against a plain reference (the set of maximal
cached token tuples), with running caller sequences that fork, rewind and go away while the
tree holds their prefixes."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cellcache import PrefixCache
from cellcache.prefix import PrefixEvent, prefix_key
from tests.helpers_prefix import World, make_cache

EXAMPLES = max(20, int(os.environ.get("CELLCACHE_MACHINE_EXAMPLES", "1000")) // 5)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixMachine(RuleBasedStateMachine):
    """The tree against the set of maximal cached tuples ``self.ref``; callers' sequences are
    checked to hold their tokens after every step (so eviction never took their cells)."""

    @initialize(policy=st.sampled_from(["lru", "lfu", "priority"]), tree_seqs=st.integers(1, 4),
                cache_seqs=st.sampled_from([5, 9]), capacity=st.sampled_from([40, 96]),
                toks=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def build(self, policy, tree_seqs, cache_seqs, capacity, toks):
        self.cache = make_cache(capacity, cache_seqs, max_write=8)
        self.events: list[PrefixEvent] = []
        self.prefix = PrefixCache(self.cache, policy, max_seqs=min(tree_seqs, cache_seqs),
                                  on_event=self.events.append)
        self.world = World(self.cache)
        self.ref: set[tuple[int, ...]] = set()
        self.pins: list[tuple[tuple[int, ...], int]] = []
        # one prompt cached to start from
        s = self.world.new(toks)
        assert self.prefix.insert(s, toks) == len(toks)
        self.apply_events()
        self.ref_add(tuple(toks))

    # the reference ---------------------------------------------------------------------------
    def ref_lcp(self, toks) -> int:
        return max((lcp(p, toks) for p in self.ref), default=0)

    def ref_add(self, path: tuple) -> None:
        if any(p[:len(path)] == path for p in self.ref):
            return
        self.ref = {p for p in self.ref if path[:len(p)] != p}
        self.ref.add(path)

    def apply_events(self) -> list[PrefixEvent]:
        """Replays evicted/invalidated events on the reference; returns the stored ones."""
        stored = []
        for ev in self.events:
            toks = tuple(ev.tokens.tolist())
            assert ev.key == prefix_key(toks)
            if ev.kind in ("evicted", "dropped"):
                assert toks in self.ref, (toks, self.ref)
                on_it = [(pin, n) for pin, n in self.pins
                         if len(toks) - ev.n < n <= len(toks) and toks[:n] == pin]
                if ev.kind == "evicted":
                    assert not on_it, "a pinned prefix was evicted"
                else:                     # a lent leaf its lender reclaimed without an id
                    self.pins = [p for p in self.pins if p not in on_it]
                self.ref.remove(toks)
                rest = toks[:len(toks) - ev.n]
                if rest and not any(p[:len(rest)] == rest for p in self.ref):
                    self.ref.add(rest)
            elif ev.kind in ("cleared", "invalidated"):
                self.ref = set()
                self.pins = []
            else:
                assert ev.kind == "stored"
                stored.append(ev)
        self.events.clear()
        return stored

    def callers(self) -> list[int]:
        return sorted(self.world.tokens)

    def pick(self, i: int) -> int:
        c = self.callers()
        return c[i % len(c)]

    def lent_len(self, s: int) -> int:
        """The length of the leaf caller s lends (0: none)."""
        if s not in self.prefix.lent_seqs():
            return 0
        [n] = [len(p) for p, t in self.prefix.prefixes() if t == s]
        return n

    def reclaimed(self, s: int) -> None:
        """s's lend ended by reclaim: the prefix kept (owned now) or dropped (events)."""
        n = self.lent_len(s)
        path = tuple(self.world.tokens[s][:n])
        kept = self.prefix.reclaim(s)
        dropped = [ev for ev in self.events if ev.kind == "dropped"]
        self.apply_events()
        assert s not in self.prefix.lent_seqs()
        event("reclaim: kept" if kept else "reclaim: nothing lent" if not n else "reclaim: dropped")
        if kept:
            assert not dropped and any(p == path and self.prefix.owns(t)
                                       for p, t in self.prefix.prefixes())
        elif n:
            assert dropped and dropped[0].tokens.tolist() == list(path)

    # caller sequences -------------------------------------------------------------------------
    @rule(toks=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def new_caller(self, toks):
        s = self.world.new(toks, evict_with=self.prefix)
        self.apply_events()
        if s is None:
            assert len(self.cache.live_seqs()) == self.cache.max_seqs

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), toks=st.lists(st.integers(0, 3), min_size=1, max_size=10))
    def extend(self, i, toks):
        self.world.write(self.pick(i), toks, evict_with=self.prefix)
        self.apply_events()

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), upto=st.integers(0, 20))
    def fork(self, i, upto):
        s = self.pick(i)
        t = self.cache.seq_clone(s, upto)
        if t is not None:
            self.world.tokens[t] = self.world.tokens[s][:upto]

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), back=st.integers(0, 6))
    def rewind(self, i, back):
        s = self.pick(i)
        p = max(0, self.cache.pos(s) - back)
        if p < self.lent_len(s):               # the lend contract: reclaim first
            self.reclaimed(s)
        assert self.cache.rewind(s, p)
        del self.world.tokens[s][p:]

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50))
    def remove(self, i):
        s = self.pick(i)
        if self.lent_len(s):
            self.reclaimed(s)
        assert self.cache.seq_rm(s)
        del self.world.tokens[s]

    # the prefix cache -------------------------------------------------------------------------
    def store(self, i, k, prio, verb):
        """insert, give (the caller's sequence goes to the tree, its leaf, or away) or lend
        (the new leaf names the caller's sequence, which goes on)."""
        s = self.pick(i)
        toks = tuple(self.world.tokens[s][: k % (len(self.world.tokens[s]) + 1)])
        skipped = self.prefix.metrics()["insert_skipped"]
        lent = self.lent_len(s)
        got = getattr(self.prefix, verb)(s, np.array(toks, np.int64), priority=prio)
        stored = self.apply_events()
        give = verb == "give"
        if give:
            del self.world.tokens[s]
        event(f"{verb}: stored" if got else f"{verb}: cached or skipped")
        if lent:
            event(f"{verb} by a lender")
        if got:
            [ev] = stored
            assert ev.tokens.tolist() == list(toks) and ev.n == got
            assert got == len(toks) - self.ref_lcp(toks)
            self.ref_add(toks)
            assert not give or (self.prefix.owns(s) and self.cache.pos(s) == len(toks))
            if verb == "lend":
                assert s in self.prefix.lent_seqs() and self.lent_len(s) == len(toks)
        else:
            assert not stored
            # given: removed, or (a lender whose leaf the tokens do not run on from) the
            # tree's now, holding that leaf
            assert not give or s not in self.cache.live_seqs() or (
                lent and self.prefix.owns(s) and self.cache.pos(s) == lent)
            assert (not toks or self.ref_lcp(toks) == len(toks)
                    or self.prefix.metrics()["insert_skipped"] == skipped + 1)

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def insert(self, i, k, prio):
        self.store(i, k, prio, "insert")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def give(self, i, k, prio):
        self.store(i, k, prio, "give")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def lend(self, i, k, prio):
        self.store(i, k, prio, "lend")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50))
    def reclaim(self, i):
        self.reclaimed(self.pick(i))

    def query(self, source, i, cut, tail):
        if source == 0 and self.ref:
            base = sorted(self.ref)[i % len(self.ref)]
        elif source == 1 and self.world.tokens:
            base = tuple(self.world.tokens[self.pick(i)])
        else:
            base = ()
        return (base if cut is None else base[: cut % (len(base) + 1)]) + tuple(tail)

    @rule(source=st.integers(0, 2), i=st.integers(0, 50), cut=st.none() | st.integers(0, 40),
          tail=st.lists(st.integers(0, 3), max_size=4), max_len=st.none() | st.integers(0, 30),
          pin=st.booleans())
    def match(self, source, i, cut, tail, max_len, pin):
        q = self.query(source, i, cut, tail)
        limited = q if max_len is None else q[:max_len]
        want = self.ref_lcp(limited)
        assert self.prefix.peek(list(q), max_len=max_len) == want
        seq, n = self.prefix.match(np.array(q, np.int32), max_len=max_len, pin=pin)
        assert not self.apply_events()
        event("match: hit" if seq is not None else "match: no id" if want else "match: miss")
        if seq is None:
            assert n == 0
            assert want == 0 or len(self.cache.live_seqs()) == self.cache.max_seqs
            return
        assert n == want > 0 and self.cache.pos(seq) == n
        assert seq not in self.world.tokens and seq not in self.prefix.owned_seqs()
        self.world.tokens[seq] = list(limited[:n])
        if pin:
            self.pins.append((limited[:n], n))

    @rule(source=st.integers(0, 2), i=st.integers(0, 50), cut=st.none() | st.integers(0, 40),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=8),
          keep=st.sampled_from(["running", "insert + remove", "give", "lend",
                                "lend + give"]))
    def serve(self, source, i, cut, tail, keep):
        """A generator's request: match (one token left to feed), compute the rest, insert
        (or lend); the request keeps running or finishes (insert then seq_rm, or give;
        lent: runs on a few tokens, then gives)."""
        q = self.query(source, i, cut, tail)
        want = self.ref_lcp(q[:-1])
        seq, n = self.prefix.match(list(q), max_len=len(q) - 1)
        if seq is None:
            assert n == 0 and (want == 0 or len(self.cache.live_seqs()) == self.cache.max_seqs)
            seq = self.world.new([], evict_with=self.prefix)
            self.apply_events()
            if seq is None:
                return
        else:
            assert n == want
            self.world.adopt(seq, q[:n])
        event("serve: hit" if n else "serve: miss")
        done = self.world.write(seq, q[n:], evict_with=self.prefix)
        self.apply_events()
        if keep == "give":
            self.give(self.callers().index(seq), n + done, 0)
            return
        if keep.startswith("lend"):
            self.lend(self.callers().index(seq), n + done, 0)
            if keep == "lend + give" and seq in self.world.tokens:
                more = self.world.write(seq, tail, evict_with=self.prefix)
                self.apply_events()
                self.give(self.callers().index(seq), n + done + more, 0)
            return
        self.insert(self.callers().index(seq), n + done, 0)
        if keep != "running":
            self.remove(self.callers().index(seq))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 50))
    def unpin(self, i):
        toks, n = self.pins.pop(i % len(self.pins))
        self.prefix.unpin(list(toks), n)

    @rule(n_cells=st.integers(0, 40), n_ids=st.integers(0, 2))
    def evict(self, n_cells, n_ids):
        before = self.world.snapshot()
        free = self.cache.free_cells
        owned = len(self.prefix.owned_seqs())
        freed = self.prefix.evict(n_cells, n_ids=n_ids)
        self.apply_events()
        assert freed == self.cache.free_cells - free
        assert self.world.snapshot() == before           # no caller sequence lost a cell
        released = owned - len(self.prefix.owned_seqs())
        if freed < n_cells or released < n_ids:
            # it stopped short: every leaf left is pinned
            assert self.prefix.evictable_tokens() == 0

    @rule(how=st.sampled_from(["clear", "cache.clear + invalidate", "cache.clear + validate"]))
    def reset(self, how):
        if how == "clear":
            free = self.cache.free_cells
            freed = self.prefix.clear()
            assert freed == self.cache.free_cells - free
        else:
            self.cache.clear()
            self.world = World(self.cache)
            if how.endswith("invalidate"):
                self.prefix.invalidate()
            else:
                assert self.prefix.validate() == (not self.ref)
        self.apply_events()
        assert self.ref == set() and self.pins == []
        assert self.prefix.prefixes() == [] and self.prefix.owned_seqs() == []

    # after every step -------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "prefix"):
            return
        self.prefix.check_invariants()
        self.cache.check_invariants()
        leaves = self.prefix.prefixes()
        assert {p for p, _ in leaves} == self.ref
        owned = set(self.prefix.owned_seqs())
        assert not owned & set(self.world.tokens)
        assert set(self.prefix.lent_seqs()) <= set(self.world.tokens)
        assert len(owned) <= self.prefix.max_seqs
        # every cached node's cells hold exactly its tokens at its positions
        for path, s in leaves:
            self.world.holds(s, path)
        # a limit stops the count, it never changes it (the owned leaves are counted first)
        whole = self.prefix.evictable_tokens()
        for lim in (1, 3, 10, 40):
            assert self.prefix.evictable_tokens(lim) == min(whole, lim)
        # every caller sequence still holds its tokens
        for s, toks in self.world.tokens.items():
            assert self.cache.pos(s) == len(toks)
            self.world.holds(s, toks)
        m = self.prefix.metrics()
        assert m["cached_tokens"] == len({p[:k] for p in self.ref for k in range(1, len(p) + 1)})
        assert m["pins"] == len(self.pins)


PrefixMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40,
                                           deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
