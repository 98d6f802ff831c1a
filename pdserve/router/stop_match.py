"""Stop strings found incrementally, in time linear in the text (issue 40 item 3).

`StopAutomaton` is an Aho-Corasick automaton over a request's stop strings, built once per request
(and cached for repeats); `StopMatcher` is one choice's position in it. The automaton's state is the
longest end of the text seen so far that begins some stop string, so its depth is exactly the text
to hold back, and every stop string that ends at a character is found from that character's state
alone: each character costs O(1) amortized, however long the stop strings (up to 16 of 1,024
characters each) and the held-back text are. Text that cannot begin a stop string is skipped at C
speed (a regular expression of the stop strings' first characters).

`feed(text)` -> (text to release now, stopped). When stop strings occur, the one that begins first
cuts the text there (as `min(text.find(s))` over the held-back text plus the new one would).
"""

from __future__ import annotations

import re
from functools import lru_cache


class StopAutomaton:
    def __init__(self, stops: tuple[str, ...]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.ends = [0]  # length of the longest stop string that is a suffix of the node's text
        for s in stops:
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.ends.append(0)
                node = nxt
            self.ends[node] = len(s)
        self.fail = [0] * len(self.goto)
        queue = list(self.goto[0].values())
        for node in queue:  # breadth first: a node's fail link is set before its children's
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                self.ends[child] = self.ends[child] or self.ends[self.fail[child]]
                queue.append(child)
        self.longest = max(map(len, stops), default=0)
        firsts = "".join(sorted(self.goto[0]))
        self.first = re.compile(f"[{re.escape(firsts)}]") if firsts else None


@lru_cache(maxsize=64)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopMatcher:
    """One choice's stop-string state: the held-back text and its node in the automaton."""

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.auto = automaton(tuple(s for s in stops if s))
        self.node, self.held = 0, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that may go out now, whether a stop string ended it)."""
        auto, node, base = self.auto, self.node, len(self.held)
        if auto.first is None:
            return text, False
        goto, fail, ends = auto.goto, auto.fail, auto.ends
        cut, i, n = -1, 0, len(text)
        while i < n:
            if node == 0:  # nothing pending: jump to the next character that begins a stop string
                m = auto.first.search(text, i)
                if m is None:
                    break
                i = m.start()
            ch = text[i]
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            i += 1
            if ends[node]:
                start = base + i - ends[node]
                cut = start if cut < 0 else min(cut, start)
            if cut >= 0 and base + i + 1 - auto.longest >= cut:
                break  # no stop string ending later can begin before `cut`
        if cut >= 0:
            whole, self.node, self.held = self.held + text, 0, ""
            return whole[:cut], True
        self.node, keep = node, auto.depth[node]
        if keep == base + n:  # all of it may still begin a stop string
            self.held += text
            return "", False
        if keep <= n:
            out, self.held = self.held + text[: n - keep], text[n - keep :]
            return out, False
        whole = self.held + text
        self.held = whole[base + n - keep :]
        return whole[: base + n - keep], False

    def flush(self) -> str:
        """The held-back text at the end (no stop string completed it)."""
        out, self.node, self.held = self.held, 0, ""
        return out
