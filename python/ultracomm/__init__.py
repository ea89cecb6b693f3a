"""ultracomm."""
