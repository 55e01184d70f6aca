"""The one exception type for bad input: the CLI prints its message (which names the file, key or id) and
exits 2 without a stack trace. Bugs stay ordinary exceptions so that they keep their traceback."""


class UserError(Exception):
    pass
