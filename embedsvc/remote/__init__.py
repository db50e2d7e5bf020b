"""The engine process and the HTTP processes in front of it: one model, many processes.

``wire.py`` is what travels on the engine's socket (typed frames, never pickles);
``server.py`` serves a ``Runner`` on that socket (the engine process's loop); ``client.py``
is the front side: its ``Link`` (one socket to the engine, whose one thread sends, reads and
tracks the front's requests there) and its port (``RemotePort``); ``place.py`` is the private
directory the socket lives in.
"""
