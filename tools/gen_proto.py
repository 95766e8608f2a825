"""Regenerate the protobuf / grpclib code in ``src/trioserve/grpc/_generated``.

Usage (from the repository root, with the dev virtualenv's interpreter)::

    python tools/gen_proto.py          # regenerate in place
    python tools/gen_proto.py --check  # exit 1 if the committed files are stale

For every ``proto/*.proto`` this runs ``grpc_tools.protoc`` with ``--python_out``,
``--pyi_out`` and grpclib's ``--grpclib_python_out`` plugin, then post-processes
the output so that it works as a package:

* absolute imports between generated modules (``import model_config_pb2``)
  become package-relative (``from . import model_config_pb2``);
* descriptors are registered in a private descriptor pool (``_pool.POOL``)
  instead of protobuf's process-wide default pool.  The default pool rejects a
  second definition of the same symbol, and both ``tritonclient.grpc`` (which
  ships its own ``inference.*`` classes) and ``grpclib.health`` (which ships
  ``grpc.health.v1.*``) register these names there.  Full type names such as
  ``inference.ModelConfig`` are unchanged, so the wire format is unaffected;
* message classes get the real module name (``__name__``) as ``__module__``;
* ``*_grpc.py`` files for protos without services (which would be empty) are
  dropped.

A proto named in ``RENAMED`` is also compiled a second time under another package
(gRPC reflection's ``v1alpha`` is its ``v1`` schema under the older package name),
so the schema is written once.

The output is deterministic, so running the script twice is a no-op.  The
``--check`` result depends on the protoc bundled with grpcio-tools (it appears
in the ``Protobuf Python Version`` header of each ``*_pb2.py``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = REPO_ROOT / "src" / "trioserve" / "grpc" / "_generated"
# The model repository reads config.pbtxt into ModelConfig without importing the gRPC
# front end, so it gets its own copy of model_config's code (and its own pool).
CONFIG_OUT_DIR = REPO_ROOT / "src" / "trioserve" / "repository" / "_generated"
CONFIG_FILES = ("__init__.py", "_pool.py", "model_config_pb2.py", "model_config_pb2.pyi")

PLUGIN_NAME = "protoc-gen-grpclib_python"

# Second compilations: new file name -> (proto in PROTO_DIR, its package, the new package).
RENAMED = {
    "reflection_v1alpha.proto": (
        "reflection_v1.proto",
        "grpc.reflection.v1",
        "grpc.reflection.v1alpha",
    ),
}

INIT_PY = '"""Code generated from proto/*.proto by tools/gen_proto.py; do not edit."""\n'

POOL_PY = '''\
"""Private descriptor pool for the generated modules (see tools/gen_proto.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
'''

# Files in OUT_DIR that this script owns; anything else there is left alone.
MANAGED = re.compile(r"^(?:\w+_pb2\.pyi?|\w+_grpc\.py|__init__\.py|_pool\.py)$")


class GenerationError(RuntimeError):
    pass


def _find_plugin(workdir: Path) -> Path:
    """Locate grpclib's protoc plugin, preferring the running interpreter's bin dir."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(PLUGIN_NAME, path=search)
    if found:
        return Path(found)
    # Fall back to a tiny wrapper around the plugin module.
    wrapper = workdir / PLUGIN_NAME
    wrapper.write_text(
        f"#!{sys.executable}\nfrom grpclib.plugin.main import main\nmain()\n", encoding="utf-8"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


def _write_renamed(dest: Path) -> None:
    """Write the ``RENAMED`` protos into ``dest``, their package line changed."""
    dest.mkdir()
    for name, (source, package, new_package) in RENAMED.items():
        text = (PROTO_DIR / source).read_text(encoding="utf-8")
        text = _sub_exactly(
            rf"^package {re.escape(package)};$", f"package {new_package};", text, 1, source
        )
        (dest / name).write_text(text, encoding="utf-8")


def _run_protoc(protos: list[Path], dest: Path, workdir: Path) -> None:
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={workdir / 'renamed'}",
        f"--proto_path={well_known}",
        f"--plugin={PLUGIN_NAME}={_find_plugin(workdir)}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpclib_python_out={dest}",
        *(p.name for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise GenerationError(f"protoc failed with exit status {rc}")


def _sub_exactly(pattern: str, repl: str, text: str, count: int, where: str) -> str:
    new, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    if n != count:
        raise GenerationError(
            f"{where}: expected {count} match(es) of {pattern!r}, found {n}; "
            "has the protoc output format changed?"
        )
    return new


def _relativize_imports(text: str, modules: set[str]) -> str:
    """Turn imports of sibling generated modules into package-relative ones."""

    def plain(m: re.Match[str]) -> str:
        mod, alias = m.group(1), m.group(2)
        return f"from . import {mod}{alias}" if mod in modules else m.group(0)

    def from_(m: re.Match[str]) -> str:
        mod = m.group(1)
        return f"from .{mod} import " if mod in modules else m.group(0)

    text = re.sub(r"^import (\w+)((?: as \w+)?)$", plain, text, flags=re.MULTILINE)
    return re.sub(r"^from (\w+) import ", from_, text, flags=re.MULTILINE)


def _postprocess(name: str, text: str, modules: set[str]) -> str:
    text = _relativize_imports(text, modules)
    if name.endswith("_pb2.py"):
        text = _sub_exactly(
            r"^(# @@protoc_insertion_point\(imports\))$",
            r"from . import _pool\n\1",
            text,
            1,
            name,
        )
        text = _sub_exactly(
            r"_descriptor_pool\.Default\(\)\.AddSerializedFile\(",
            "_pool.POOL.AddSerializedFile(",
            text,
            1,
            name,
        )
        text = _sub_exactly(
            r"^(_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'\w+', _globals\)$",
            r"\1__name__, _globals)",
            text,
            1,
            name,
        )
    for mod in modules:
        if re.search(rf"^import {mod}\b", text, flags=re.MULTILINE):
            raise GenerationError(f"{name}: absolute import of {mod} left after rewriting")
    return text


def generate() -> dict[str, str]:
    """Run protoc and return {file name: final content} for the generated package."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise GenerationError(f"no .proto files in {PROTO_DIR}")
    stems = [p.stem for p in protos] + [Path(name).stem for name in RENAMED]
    modules = {f"{stem}_pb2" for stem in stems} | {f"{stem}_grpc" for stem in stems}

    with tempfile.TemporaryDirectory(prefix="trioserve-gen-proto-") as tmp:
        tmpdir = Path(tmp)
        raw = tmpdir / "out"
        raw.mkdir()
        _write_renamed(tmpdir / "renamed")
        _run_protoc([*protos, *(tmpdir / "renamed" / name for name in RENAMED)], raw, tmpdir)

        result: dict[str, str] = {"__init__.py": INIT_PY, "_pool.py": POOL_PY}
        for path in sorted(raw.iterdir()):
            text = path.read_text(encoding="utf-8")
            if path.name.endswith("_grpc.py") and "class " not in text:
                continue  # proto without services: the grpclib module would be empty
            result[path.name] = _postprocess(path.name, text, modules)
    return result


def _current_files(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {
        p.name: p.read_text(encoding="utf-8")
        for p in sorted(directory.iterdir())
        if p.is_file() and MANAGED.match(p.name)
    }


def write(files: dict[str, str], directory: Path) -> list[str]:
    """Make the managed files in ``directory`` equal to ``files``; return what changed."""
    directory.mkdir(parents=True, exist_ok=True)
    current = _current_files(directory)
    changed = []
    for name in sorted(set(current) - set(files)):
        (directory / name).unlink()
        changed.append(f"removed {name}")
    for name, text in sorted(files.items()):
        if current.get(name) != text:
            (directory / name).write_text(text, encoding="utf-8", newline="\n")
            changed.append(f"{'updated' if name in current else 'created'} {name}")
    return changed


def check(files: dict[str, str], directory: Path) -> list[str]:
    """Return human-readable differences between ``files`` and ``directory``."""
    current = _current_files(directory)
    problems = []
    for name in sorted(set(current) | set(files)):
        if name not in files:
            problems.append(f"{name}: stale file, not produced by the generator")
        elif name not in current:
            problems.append(f"{name}: missing")
        elif current[name] != files[name]:
            diff = difflib.unified_diff(
                current[name].splitlines(keepends=True),
                files[name].splitlines(keepends=True),
                fromfile=f"committed/{name}",
                tofile=f"regenerated/{name}",
                n=1,
            )
            lines = [ln if len(ln) <= 160 else ln[:157] + "...\n" for ln in list(diff)[:40]]
            problems.append(f"{name}: differs\n" + "".join(lines))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary directory and fail if the committed files differ",
    )
    args = parser.parse_args(argv)

    try:
        files = generate()
    except GenerationError as exc:
        print(f"gen_proto: {exc}", file=sys.stderr)
        return 2

    outputs = [(OUT_DIR, files), (CONFIG_OUT_DIR, {n: files[n] for n in CONFIG_FILES})]
    status = 0
    for directory, produced in outputs:
        rel = directory.relative_to(REPO_ROOT)
        if args.check:
            problems = check(produced, directory)
            if problems:
                print(f"gen_proto: {rel} is out of date:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                print("run `python tools/gen_proto.py` to regenerate", file=sys.stderr)
                status = 1
            else:
                print(f"gen_proto: {rel} is up to date ({len(produced)} files)")
            continue
        changed = write(produced, directory)
        for line in changed:
            print(f"gen_proto: {line}")
        print(f"gen_proto: {rel}: {len(changed)} change(s), {len(produced)} files")
    return status


if __name__ == "__main__":
    sys.exit(main())
