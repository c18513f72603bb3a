"""unison.adapter_extension's pure logic, in-process: what a build is cached
under, and which cache folders it refuses to load from. Building and loading
a real extension is tests/test_adapter_builds.py's."""
import os
import shutil

import pytest

from unison import adapter_extension
from unison.exceptions import InvalidArgumentError


def install(root, source_text=b"int x;\n"):
    """A fake installation: unison's source and header, and a framework."""
    os.makedirs(os.path.join(root, "unison", "include"))
    os.makedirs(os.path.join(root, "framework", "include"))
    source = os.path.join(root, "unison", "ext.cc")
    with open(source, "wb") as f:
        f.write(source_text)
    shutil.copy(os.path.join(adapter_extension.HEADERS, "unison.h"), os.path.join(root, "unison", "include"))
    return source, os.path.join(root, "unison", "include"), os.path.join(root, "framework")


def key(root, source_text=b"int x;\n", versions=("2.13.0",), flags=("-O2",)):
    source, headers, framework = install(root, source_text)
    return adapter_extension.cache_key(source, headers, "/usr/bin/g++",
                                       list(flags) + ["-I" + headers, "-isystem", framework + "/include", source],
                                       versions, framework)


def test_environments_with_the_same_build_share_a_key_and_any_difference_makes_another(tmp_path):
    first = key(str(tmp_path / "env1"))
    assert key(str(tmp_path / "env2")) == first   # the same files elsewhere
    assert key(str(tmp_path / "env3"), source_text=b"int y;\n") != first
    assert key(str(tmp_path / "env4"), versions=("2.14.0",)) != first
    assert key(str(tmp_path / "env5"), flags=("-O3",)) != first


def test_a_header_beside_the_source_that_it_includes_is_part_of_the_key(tmp_path):
    # kernels.cc and kernels_xla.cc share kernels_core.h: a change to it
    # must rebuild both. A header it does not include, or one found
    # elsewhere (<...> or a path), is not read.
    text = b'#include "shared.h"\n#include <vector>\n#include "tensorflow/core/framework/op.h"\nint x;\n'

    def key_with(root, header):
        source, headers, framework = install(root, text)
        with open(os.path.join(os.path.dirname(source), "shared.h"), "wb") as f:
            f.write(header)
        with open(os.path.join(os.path.dirname(source), "unrelated.h"), "wb") as f:
            f.write(root.encode())
        return adapter_extension.cache_key(source, headers, "/usr/bin/g++", ["-O2", source], ("2.13.0",), framework)
    first = key_with(str(tmp_path / "env1"), b"int a;\n")
    assert key_with(str(tmp_path / "env2"), b"int a;\n") == first
    assert key_with(str(tmp_path / "env3"), b"int b;\n") != first


def test_a_cache_folder_others_may_write_or_a_link_is_refused_naming_it(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    with pytest.raises(adapter_extension.Unavailable, match="the folder %s may be written by other users "
                       r"\(mode 775\); nothing there is loaded" % shared):
        adapter_extension._private_folder(str(shared))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(adapter_extension.Unavailable, match="is not a folder"):
        adapter_extension._check_private(str(link), folder=True)
    fresh = tmp_path / "fresh" / "extensions"
    adapter_extension._private_folder(str(fresh))
    assert oct(fresh.stat().st_mode & 0o777) == oct(0o700)


def test_the_cache_folder_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "c"))
    assert adapter_extension.cache_folder() == str(tmp_path / "c")
    monkeypatch.delenv("UNISON_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert adapter_extension.cache_folder() == str(tmp_path / "xdg" / "unison")
    monkeypatch.setenv("UNISON_TORCH_FAST_PATH", "perhaps")
    with pytest.raises(InvalidArgumentError, match="UNISON_TORCH_FAST_PATH='perhaps'"):
        adapter_extension.auto_or_flag("UNISON_TORCH_FAST_PATH")
    for value, meaning in [("auto", -1), (" On ", 1), ("0", 0), ("false", 0)]:
        monkeypatch.setenv("UNISON_TORCH_FAST_PATH", value)
        assert adapter_extension.auto_or_flag("UNISON_TORCH_FAST_PATH") == meaning
