"""Generated protobuf package (see scripts/gen_proto.py)."""
