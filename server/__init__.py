"""radixkv package."""
