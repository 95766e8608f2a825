"""Code generated from proto/*.proto by tools/gen_proto.py; do not edit."""
