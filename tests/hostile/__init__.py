"""Hostile peers: engines, clients and registrations that send what no well-behaved peer
would (issue 19). Each case asserts the fixed behaviour, that no other client receives
another's bytes, that ``/health`` stays fast during the attack and that memory stays bounded."""
