"""What a grammar can be refused for, importable without xgrammar (the API process raises and catches these before
any grammar is compiled there)."""


class GrammarError(ValueError):
    """The spec does not describe a valid grammar; the message says why (xgrammar's words, without its location)."""


class GrammarBudgetError(GrammarError):
    """The grammar is valid but costs more (time or memory) than this server allows a request."""


class GrammarTimeout(GrammarBudgetError):
    """The grammar's work ran past its deadline."""
