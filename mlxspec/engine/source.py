"""Who proposes a step's drafts (`Source`): none (an autoregressive step), the model drafter, or
a lookup, with what the policy keeps an acceptance estimate for (`mlxspec.engine.policy`)."""

from __future__ import annotations

from enum import Enum


class Kind(Enum):
    NONE = "none"  # an autoregressive step: nothing drafted
    DRAFTER = "drafter"  # the drafter's own draft() (a model; for --spec-type ngram, its lookup)
    LOOKUP = "lookup"  # prompt lookup beside a model drafter


class Source(str):
    """Who proposes a step's drafts: a `Kind`, and for a lookup the length of the n-gram that
    matched (`match`; 0 = any length, the pooled estimate) and whether the match was found in
    the text of earlier requests (`shared`: suffix drafting's shared index) rather than in this
    request's own. Its text is the name reports and older callers use ("none", "drafter",
    "lookup", "lookup3", "lookup8s"); decisions read kind, match and shared."""

    def __new__(cls, kind: Kind, match: int = 0, shared: bool = False):
        lookup = kind is Kind.LOOKUP
        shared = bool(shared) and lookup
        name = (f"lookup{match or ''}" + ("s" if shared else "")) if lookup else kind.value
        self = super().__new__(cls, name)
        self.kind, self.match, self.shared = kind, int(match) if lookup else 0, shared
        return self

    def __reduce__(self):
        return Source, (self.kind, self.match, self.shared)

    @classmethod
    def lookup(cls, match: int = 0, shared: bool | None = None) -> "Source":
        """A lookup's source; `shared` defaults to what the match says of itself (a suffix
        lookup's `engine.suffix.Match`)."""
        return cls(Kind.LOOKUP, match, getattr(match, "shared", False) if shared is None else shared)

    @classmethod
    def of(cls, name: "str | Source") -> "Source":
        """A Source from its name ("drafter", "lookup3", "lookup8s", ...)."""
        if isinstance(name, Source):
            return name
        if name.startswith("lookup"):
            rest = name[len("lookup"):]
            shared = rest.endswith("s")
            return cls(Kind.LOOKUP, int(rest.rstrip("s") or 0), shared)
        return cls(Kind(name))

    @property
    def is_lookup(self) -> bool:
        return self.kind is Kind.LOOKUP

    @property
    def pooled(self) -> "Source":
        """The pooled estimate a lookup's match length is shrunk towards: every match length
        found in the same place (this request, or the shared index)."""
        return Source.lookup(0, self.shared)


Source.NONE, Source.DRAFTER, Source.LOOKUP = Source(Kind.NONE), Source(Kind.DRAFTER), Source(Kind.LOOKUP)
