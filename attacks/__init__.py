"""placeholder init"""
