"""HTTP front end of the gateway (FastAPI): OpenAI and Anthropic APIs, health, models, metrics.

Pydantic models live only in this package. ``gateway.http.app.create_app`` builds the app.
"""
