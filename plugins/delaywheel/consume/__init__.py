"""Consuming topics: pull/ack with the retry ladder and DLQ, and the consumer that waits for deliveries."""
