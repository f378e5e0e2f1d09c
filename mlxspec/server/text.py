"""One request's committed tokens -> the text sent to its client (`TextStream`), and the stop
string that ended it (`matched_stop`)."""

from __future__ import annotations


class TextStream:
    """One request's committed tokens -> the text to send, as `api.stream_generate` makes it
    (detokenizer, EOS and max_tokens, stop strings with the tail that may start one held
    back), pushed a step's tokens at a time instead of pulled from the engine."""

    def __init__(self, tokenizer, eos: set, max_tokens: int, stop: list[str]):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos, self.max_tokens = eos, max_tokens
        self.stop = [x for x in stop if x]
        self.text_so_far, self.sent, self.emitted = "", 0, 0
        self.tokens: list[int] = []
        self.finish: str | None = None

    def feed(self, committed: list[int]) -> str:
        """The text of one step's tokens (stops at the first finish; `finish` tells why)."""
        out = ""
        for tok in committed:
            self.emitted += 1
            self.tokens.append(tok)
            finish = "stop" if tok in self.eos else ("length" if self.emitted >= self.max_tokens else None)
            if tok not in self.eos:
                self.detok.add_token(tok)
            if finish:
                self.detok.finalize()
            seg = self.detok.last_segment
            if self.stop:
                self.text_so_far += seg
                hit = min((self.text_so_far.find(x) for x in self.stop if x in self.text_so_far), default=-1)
                if hit >= 0:
                    finish, end = "stop", hit
                elif finish:
                    end = len(self.text_so_far)
                else:
                    end = len(self.text_so_far) - max(
                        (k for x in self.stop for k in range(1, len(x)) if self.text_so_far.endswith(x[:k])), default=0)
                seg = self.text_so_far[self.sent:end]
                self.sent += len(seg)
            out += seg
            if finish:
                self.finish = finish
                break
        return out


def matched_stop(full: str, stop: list[str]) -> str:
    """The stop string that ended a generation whose text (stop string included) is `full`:
    the occurrence that completes first, as `stream_generate` stops at it."""
    found = [(full.find(x) + len(x), i) for i, x in enumerate(stop) if x and x in full]
    return stop[min(found)[1]] if found else next((x for x in stop if x), None)
