"""Object stores (S3, GCS, Azure, HTTP) through obstore (private)."""
