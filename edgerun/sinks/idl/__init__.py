"""Wire types for the DDS sink: edgerun's own (``native``) and ROS 2 vision_msgs 4.x (``ros2``)."""
