"""Leaves that read finished runs or measure: analysis (reports and plots from run
directories), viz (attention maps), bench (speed and memory). Nothing imports them."""
