"""Private descriptor pool for the generated modules (see tools/gen_proto.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
