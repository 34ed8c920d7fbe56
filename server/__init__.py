"""remote_accel.server"""
