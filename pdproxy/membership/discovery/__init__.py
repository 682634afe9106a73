"""Where registrations come from: vLLM engines' heartbeats on a ZMQ socket (``zmq``, its wire
schema in ``messages``, its allow-list in ``zap``) and the registry replicas share on etcd
(``etcd``; its data in ``shared``, one replica's side in ``replica``). Each turns its input into
what ``Membership`` admits."""
