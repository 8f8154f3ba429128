"""The gRPC engine service (engine.proto), its server side and its client side."""
