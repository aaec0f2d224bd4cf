"""The schema's messages as bytes: hand-written codecs of the messages that dominate the wire,
the strict protobuf wire reading, and the one module touching betterproto2's internals."""
