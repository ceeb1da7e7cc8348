//! The supervised actors of an instance and of the proxy (built by the serving-instance issue).
