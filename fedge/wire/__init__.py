"""What travels between roles: the message type and its codec, typed metadata fields, chunking, the MQTT protocol and
the run's live status."""
