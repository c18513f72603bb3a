"""A rank's entry point for unison.run(func): `python -m
unison.runner.function_rank` fetches the call, runs it and sends back what
it returned (function.worker).

It is a module of its own, not `python -m unison.runner.function`, because
`import unison` imports unison.runner.function (for unison.run), so running
that module as __main__ would load it twice: Python warns about it
(RuntimeWarning on every rank), and the script a rank imports would reach
the other copy."""
import sys

from unison.runner import function

if __name__ == "__main__":
    sys.exit(function.worker())
