"""remote_accel.tools"""
