"""A shared-memory transport between trioserve's processes, knowing nothing of models.

Tensor bytes go once into an ``Arena`` (anonymous shared memory the writer owns) and
are read in place by the peer through its ``SegmentMap``; control messages go as frames
over a local stream socket (``TrioChannel`` in the event loop, ``BlockingChannel`` in a
child's threads), the segments' descriptors riding along with the first frame that uses
them. ``Replies`` and ``PendingCalls`` match answers to the requests that await them.
"""

from ._arena import ALIGNMENT, Arena, ArenaFull, Block, SegmentMap, anonymous_memory
from ._blocking import BlockingChannel, LinkClosed, channel_pair
from ._channels import TrioChannel
from ._frames import FrameError, FrameReader, Outgoing, encode_frames
from ._replies import Pending, PendingCalls, Replies

__all__ = [
    "ALIGNMENT",
    "Arena",
    "ArenaFull",
    "Block",
    "BlockingChannel",
    "FrameError",
    "FrameReader",
    "LinkClosed",
    "Outgoing",
    "Pending",
    "PendingCalls",
    "Replies",
    "SegmentMap",
    "TrioChannel",
    "anonymous_memory",
    "channel_pair",
    "encode_frames",
]
