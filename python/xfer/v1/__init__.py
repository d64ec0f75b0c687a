"""Generated gRPC stubs (xfer_pb2, xfer_pb2_grpc) are written here at build time."""
