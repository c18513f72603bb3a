"""`python -m unison.run`: unisonrun's command line under the name it has
always had. The launcher lives in unison.runner (runner/launch.py); as a
name in the package, `unison.run` is the function that starts ranks from
Python (runner/function.py), as `horovod.run` is. Importing this file as a
module would replace that function with it, so only running it is
allowed."""
import sys

if __name__ != "__main__":
    raise ImportError("unison.run is a function (unison.run(func, num_proc=2)); the launcher's package is "
                      "unison.runner, and its command line `unisonrun` or `python -m unison.runner`")

from unison.runner.launch import main  # noqa: E402

sys.exit(main())
