"""Regenerate the committed Python package for proto/dapo/v1 (messages, gRPC stubs, .pyi).

Usage: python scripts/gen_proto.py [--out DIR]   (default: proto/, next to the sources)

Stale generated files are deleted first, so a removed .proto leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("dapo") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc over every .proto in proto/dapo/v1 and return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    target = out / PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.iterdir():
        if stale.name.endswith(GENERATED_SUFFIXES):
            stale.unlink()
    for init in (out / "dapo" / "__init__.py", target / "__init__.py"):
        if not init.exists():
            init.write_text('"""Generated protobuf package (see scripts/gen_proto.py)."""\n')
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in target.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    written = generate(parser.parse_args(argv).out)
    print(f"wrote {len(written)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
