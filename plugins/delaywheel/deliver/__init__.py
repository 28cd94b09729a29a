"""Delivery: level queues and the timing wheel moved into their topics when due, and the loop that drives them."""
